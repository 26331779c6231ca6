"""Under torchrun, this rank on one CPU of its own, then the rest of the command line:
`torchrun ... tests/programs/pinned_rank.py python -m tuneup run train.py ...` runs local rank
R on the R-th CPU this process may use (as `taskset -c` would per rank). The affinity passes
through exec to the training process and every thread it starts."""

import os
import sys

cpus = sorted(os.sched_getaffinity(0))
os.sched_setaffinity(0, {cpus[int(os.environ["LOCAL_RANK"]) % len(cpus)]})
os.execvp(sys.argv[1], sys.argv[1:])
