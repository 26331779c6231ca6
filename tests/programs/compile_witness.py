"""What torch's own records say a program compiled, for the compiled programs that tests run
under plain python and under `tuneup run` and compare: the warnings it raised and torch's log
records (WARNING and above) from the moment `watch()` is called, and at the end one JSON line
with torch._dynamo's counters (frames, unique graphs, recompiles, graph breaks), the guards
that failed and the losses (as float.hex: bit for bit)."""

import json
import logging
import re
import warnings

SECTIONS = ("frames", "stats", "recompiles", "graph_break")


class Witness(logging.Handler):
    def __init__(self) -> None:
        super().__init__(level=logging.WARNING)
        self.warnings: list[str] = []
        self.torch_log: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.torch_log.append(f"{record.levelname}: {record.getMessage()[:200]}")

    def clear(self) -> None:
        self.warnings.clear()
        self.torch_log.clear()

    def compiled(self, every_section: bool = True) -> dict:
        from torch._dynamo.utils import counters  # (loaded by torch.compile's first call)

        return {section: dict(counters[section]) for section in SECTIONS if every_section or counters[section]}

    def print(self, tag: str, losses: list[float], guard_failures: bool = True, **fields) -> None:
        """One line `TAG {...}`: `fields`, the losses, the counters, the warnings and log records
        (and, with `guard_failures`, the guards that failed, per compiled code: a recompile each,
        and a lookup that passed over a cached graph)."""
        from torch._dynamo.utils import guard_failures as failures

        seen = dict(fields, losses=[float.hex(value) for value in losses],
                    compiled=self.compiled(every_section=guard_failures))
        if guard_failures:
            seen["guard_failures"] = {f"{code.co_name}:{code.co_firstlineno}": [str(reason) for reason in reasons]
                                      for code, reasons in failures.items()}
        seen.update(warnings=sorted(set(self.warnings)), torch_log=sorted(set(self.torch_log)))
        print(f"{tag} " + json.dumps(seen), flush=True)


def watch() -> Witness:
    """Every warning kept (a process id in a message, as in fork()'s DeprecationWarning, made one:
    it differs run to run), and torch's log records of WARNING and above."""
    witness = Witness()
    warnings.simplefilter("always")
    warnings.showwarning = lambda message, category, *rest, **kw: witness.warnings.append(
        re.sub(r"pid=\d+", "pid=N", f"{category.__name__}: {message}"))
    logging.getLogger("torch").addHandler(witness)
    return witness
