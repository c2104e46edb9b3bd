"""Pure domain values: quotas, the quota file, task intake, token estimates and the capacity bound.

No I/O here and no imports from the rest of the package (only :mod:`balancer.errors`),
so every other package may depend on this one.
"""
