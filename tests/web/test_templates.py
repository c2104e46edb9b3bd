"""The console's templates rendered on hand-made samples: what a page says, without a browser."""

from __future__ import annotations

from balancer.health.reasons import SourceFacts, assess
from balancer.web import charts
from balancer.web.app import environment
from balancer.web.sampler import Sample


def drain_fragment(sample: Sample) -> str:
    chart = charts.burn_down([(0.0, sample.left)], sample.eta_s, band=(None, None))
    return environment().get_template("_drain.html").render(sample=sample, chart=chart, history_s=60.0)


def test_the_drain_says_nothing_else_to_run_not_done_while_a_sources_write_backs_fail() -> None:
    """Every task ended, but the team's table refused each answer's write-back (a column renamed):
    `status` and the page said "done" while none of those answers had reached the table."""
    failing = assess([], [SourceFacts("crm", writeback_failing=4, writeback_failing_error="no column answer")], 0)
    page = drain_fragment(Sample(0.0, {"solved": 4}, [], {}, 0.0, health=failing))
    assert "<b>nothing else to run</b>" in page and "<b>done</b>" not in page
    assert "the answers of source <b>crm</b>: they wait to be written back" in page

    written = assess([], [SourceFacts("crm")], 0)
    page = drain_fragment(Sample(0.0, {"solved": 4}, [], {}, 0.0, health=written))
    assert "<b>done</b>" in page and "nothing else to run" not in page
