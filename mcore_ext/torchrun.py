"""``python -m mcore_ext.torchrun [torchrun's flags] PROGRAM ...``: torchrun, except for a user's
mistake.

When the ranks stop on a mistake in what the user gave them (exit code 2, the message already
printed once by the first rank: ``mcore_ext.cli``), this exits 2 with nothing more, where
torchrun prints its failure report (about 40 lines: one table entry per rank) and exits 1. Any
other failure gets torchrun's report and exit code unchanged.
"""

import logging
import os
import sys

from mcore_ext.cli import USAGE_ERROR


class _NotUsageErrors(logging.Filter):
    """Drops the agent's "failed (exitcode: 2) ..." line (other failures keep theirs) and its
    "Sending process N closing signal SIGTERM" lines (a failure's report lists those ranks)."""

    def filter(self, record) -> bool:
        if record.msg.startswith("Sending process"):
            return False
        return not (record.msg.startswith("failed (exitcode") and record.args[0] == USAGE_ERROR)


def main(argv=None) -> int:
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError, record
    from torch.distributed.run import parse_args, run

    # torchrun sets 1 too, with a banner saying so.
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    logging.getLogger("torch.distributed.elastic.multiprocessing.api").addFilter(_NotUsageErrors())

    @record  # as torchrun's main: a failed rank's error file becomes this process's
    def launch():
        run(parse_args(argv))

    try:
        launch()
    except ChildFailedError as err:
        _, first = err.get_first_failure()
        if first.exitcode == USAGE_ERROR:
            return USAGE_ERROR
        raise
    return 0


if __name__ == "__main__":
    sys.exit(main())
