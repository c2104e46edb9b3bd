"""Costs, pure: prices, what a call costs, and a source's budget per day.

* ``cost`` — prices per million tokens, spend by model and by source, what a call with no answer counts for
* ``budget`` — a source's budget per day, and whether it is spent
"""
