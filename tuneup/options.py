"""Agent options: keyword arguments win over TUNEUP_* environment variables, which win over defaults.

A bad keyword argument raises ValueError at the attach call (the user is at the keyboard).
A bad environment variable only warns and falls back to the default: a platform-wide
setting must never stop somebody's training job.
"""

from __future__ import annotations

import os
import socket
import time
from dataclasses import dataclass, fields, replace
from pathlib import Path
from typing import Any, Callable

from ._warning import warn

MODES = ("advise", "apply")


def _parse_bool(text: str) -> bool:
    value = text.strip().lower()
    if value in ("1", "true", "yes", "on"):
        return True
    if value in ("0", "false", "no", "off", ""):
        return False
    raise ValueError("expected 1/0, true/false, yes/no or on/off")


def _int_in(low: int, high: int) -> Callable[[Any], int]:
    def parse(value: Any) -> int:
        if isinstance(value, bool):
            raise ValueError(f"expected a whole number from {low} to {high}")
        try:
            number = int(str(value).strip()) if isinstance(value, str) else int(value)
        except (TypeError, ValueError):
            raise ValueError(f"expected a whole number from {low} to {high}") from None
        if number != value and not isinstance(value, str):
            raise ValueError(f"expected a whole number from {low} to {high}")
        if not low <= number <= high:
            raise ValueError(f"expected a whole number from {low} to {high}")
        return number

    return parse


def _float_in(low: float, high: float) -> Callable[[Any], float]:
    def parse(value: Any) -> float:
        try:
            number = float(str(value).strip()) if isinstance(value, str) else float(value)
        except (TypeError, ValueError):
            raise ValueError(f"expected a number of seconds from {low} to {high}") from None
        if not low <= number <= high:
            raise ValueError(f"expected a number of seconds from {low} to {high}")
        return number

    return parse


def _mode(value: Any) -> str:
    text = str(value).strip().lower()
    if text not in MODES:
        raise ValueError(f"expected one of: {', '.join(MODES)}")
    return text


def _bool(value: Any) -> bool:
    if isinstance(value, bool):
        return value
    if isinstance(value, str):
        return _parse_bool(value)
    raise ValueError("expected True or False")


def _auto_bool(value: Any) -> bool | None:
    """True/False, or None for "auto" (what the hardware reports)."""
    if isinstance(value, str) and value.strip().lower() == "auto":
        return None
    try:
        return _bool(value)
    except ValueError:
        raise ValueError("expected auto, 1/0, true/false, yes/no or on/off") from None


def _path_or_none(value: Any) -> Path | None:
    if value is None or value == "":
        return None
    if not isinstance(value, (str, os.PathLike)):
        raise ValueError("expected a directory path")
    return Path(value).expanduser()


def parse_host(value: Any) -> str:
    """The address the endpoint listens on. Empty is refused: the socket layer would take it
    for every interface, the opposite of the loopback default."""
    text = str(value).strip()
    if not text:
        raise ValueError("expected a host name or address (empty would listen on every interface: "
                         "say 0.0.0.0 if that is meant)")
    return text


def parse_nvml_module(value: Any) -> str:
    """The module that offers NVML's API: pynvml, or a stand-in named like it (`*nvml`, e.g.
    the test suite's fake). Any other name is refused before anything is imported."""
    text = str(value).strip()
    parts = text.split(".")
    if not all(part.isidentifier() for part in parts) or not parts[-1].endswith("nvml"):
        raise ValueError("expected pynvml (nvidia-ml-py) or a module named like it, e.g. mypkg.fake_nvml")
    return text


def _ids(value: Any, what: str) -> tuple[str, ...]:
    """A comma-separated string or an iterable of strings, as a tuple of stripped ids."""
    if isinstance(value, str):
        items: list[Any] = value.split(",")
    else:
        try:
            items = list(value)
        except TypeError:
            raise ValueError(f"expected {what} as a comma-separated string or a list of strings") from None
        if not all(isinstance(item, str) for item in items):
            raise ValueError(f"expected {what} as a comma-separated string or a list of strings")
    return tuple(item.strip() for item in items if item.strip())


def _port(value: Any) -> int | None:
    if value is None or (isinstance(value, str) and value.strip() == ""):
        return None
    return _int_in(0, 65535)(value)


def _gateway(value: Any) -> str | None:
    """A Pushgateway address: http(s)://host:port, or host:port (http)."""
    from urllib.parse import urlparse

    text = str(value).strip() if value is not None else ""
    if not text:
        return None
    url = text if "://" in text else f"http://{text}"
    parsed = urlparse(url)
    if parsed.scheme not in ("http", "https") or not parsed.hostname:
        raise ValueError("expected a Pushgateway address like http://pushgateway:9091 or pushgateway:9091")
    try:
        parsed.port  # noqa: B018 - raises on a bad port
    except ValueError:
        raise ValueError("expected a Pushgateway address like http://pushgateway:9091 or pushgateway:9091") from None
    return url.rstrip("/")


def _job_name(value: Any) -> str:
    text = str(value).strip()
    if not text or "/" in text:
        raise ValueError("expected a Prometheus job name without '/'")
    return text


def _label_value(value: Any) -> str:
    text = str(value).strip()
    if not text or len(text) > 200 or not text.isprintable():
        raise ValueError("expected a name of 1 to 200 printable characters (a Prometheus label value)")
    return text


def _rule_ids(value: Any) -> tuple[str, ...]:
    """Rule ids to silence: a comma-separated string or an iterable of ids."""
    from .diagnose.engine import unknown_rules

    ids = _ids(value, "rule ids")
    unknown = unknown_rules(ids)
    if unknown:
        raise ValueError(f"unknown rule id {unknown[0]!r} (see `tuneup rules` for the ids)")
    return ids


# The ids of apply mode's actions (each Action's `id`, act/actions/__init__.py: it checks them
# against these at import), here so that `tuneup run --actions` checks what it is given before
# anything imports torch: the launcher's own import of act/ imported it, a second time, ahead
# of the job's (1.6 s on a 2-core host; the many_workers run of bench_apply_scripts with
# --actions took 1.1 s longer to reach its loop than with none).
ACTION_IDS = ("dataloader", "amp", "cudnn-benchmark", "zero-grad", "gc-freeze", "compile")
OPT_IN_ACTIONS = ("compile",)  # taken only by name, never by "all" (Action.opt_in)
DEFAULT_ACTIONS = tuple(name for name in ACTION_IDS if name not in OPT_IN_ACTIONS)


def parse_actions(value: Any) -> tuple[str, ...]:
    """The actions apply mode may take: a comma-separated string or an iterable of ids;
    "all" (the default) is every action but the opt-in ones (compile), which are taken only by
    name ("all,compile")."""
    ids = _ids(value, "action ids")
    unknown = [action for action in ids if action not in ACTION_IDS and action != "all"]
    if unknown:
        raise ValueError(f"unknown action {unknown[0]!r} (the actions are: {', '.join(DEFAULT_ACTIONS)}, or all; "
                         f"only by name: {', '.join(OPT_IN_ACTIONS)})")
    if "all" in ids:
        ids = DEFAULT_ACTIONS + tuple(name for name in ids if name not in DEFAULT_ACTIONS and name != "all")
    return ids


@dataclass(frozen=True)
class Options:
    mode: str = "advise"
    run_dir: Path | None = None
    log: bool = True
    log_max_bytes: int = 64 * 1024 * 1024
    log_shared: bool = False  # run directories 0750 and logs 0640 (the group reads them) instead of 0700/0600
    interval: float = 1.0
    sync_sample_every: int | None = None  # None: 20, or every detail step where those come further apart (syncs.py sample_after)
    detail_every: int | None = None  # None: 4, further apart on short steps, by their measured cost (hotpath.py pace)
    window_steps: int = 1000
    gpu: bool = True
    nvml_module: str = "pynvml"
    disable: bool = False
    serve: bool = True
    host: str = "127.0.0.1"
    port: int | None = None  # None: DEFAULT_PORT + the local rank; 0: any free port
    push_gateway: str | None = None  # a Prometheus Pushgateway to push the metrics to (short jobs)
    push_interval: float = 15.0
    push_job: str = "tuneup"
    training_job: str | None = None  # None: what the ranks share (torchrun's rendezvous), else the run id
    silence: tuple[str, ...] = ()
    actions: tuple[str, ...] | None = None  # None: every action (apply mode only)
    cpu_bf16: bool | None = None  # None: as the CPU reports (AVX512-BF16/AMX); True/False: treat it as so


DEFAULT_PORT = 9477  # an agent's endpoint: + its local rank
DEFAULT_DAEMON_PORT = 9476  # the node daemon's


def agent_port(options: "Options", local_rank: int | None) -> int:
    """The port an agent listens on: the `port` option, else DEFAULT_PORT + its local rank
    (the ranks of a node side by side); 0 means any free port."""
    return options.port if options.port is not None else DEFAULT_PORT + (local_rank or 0)


# option name -> (environment variable, parser); the assert keeps it in step with Options.
_SPEC: dict[str, tuple[str, Callable[[Any], Any]]] = {
    "mode": ("TUNEUP_MODE", _mode),
    "run_dir": ("TUNEUP_RUN_DIR", _path_or_none),
    "log": ("TUNEUP_LOG", _bool),
    "log_max_bytes": ("TUNEUP_LOG_MAX_BYTES", _int_in(64 * 1024, 1 << 40)),
    "log_shared": ("TUNEUP_LOG_SHARED", _bool),
    "interval": ("TUNEUP_INTERVAL", _float_in(0.05, 60.0)),
    "sync_sample_every": ("TUNEUP_SYNC_SAMPLE_EVERY", _int_in(0, 1_000_000)),
    "detail_every": ("TUNEUP_DETAIL_EVERY", _int_in(1, 1_000_000)),
    "window_steps": ("TUNEUP_WINDOW_STEPS", _int_in(10, 10_000)),  # < the agent's ring of 16384
    "gpu": ("TUNEUP_GPU", _bool),
    "nvml_module": ("TUNEUP_NVML_MODULE", parse_nvml_module),
    "disable": ("TUNEUP_DISABLE", _bool),
    "serve": ("TUNEUP_SERVE", _bool),
    "host": ("TUNEUP_HOST", parse_host),
    "port": ("TUNEUP_PORT", _port),
    "push_gateway": ("TUNEUP_PUSH_GATEWAY", _gateway),
    "push_interval": ("TUNEUP_PUSH_INTERVAL", _float_in(1.0, 3600.0)),
    "push_job": ("TUNEUP_PUSH_JOB", _job_name),
    "training_job": ("TUNEUP_TRAINING_JOB", _label_value),
    "silence": ("TUNEUP_SILENCE", _rule_ids),
    "actions": ("TUNEUP_ACTIONS", parse_actions),
    "cpu_bf16": ("TUNEUP_CPU_BF16", _auto_bool),
}
assert set(_SPEC) == {f.name for f in fields(Options)}

ENVIRONMENT_VARIABLES = {name: env for name, (env, _) in _SPEC.items()}
# What a bad environment value falls back to where the default is not the safe choice: the
# default `actions` is every action, so a typo in TUNEUP_ACTIONS allows none.
_SAFE_FALLBACK: dict[str, tuple[Any, str]] = {"actions": ((), "apply mode takes no action")}
# What a default of None means, for the warning that falls back to it.
_UNSET_MEANS = {"run_dir": "./tuneup-runs/<run>", "sync_sample_every": "chosen from the step time",
                "detail_every": "chosen from the step time", "port": f"{DEFAULT_PORT} + the local rank",
                "push_gateway": "no push", "training_job": "the ranks' rendezvous, else the run id",
                "cpu_bf16": "as the CPU reports"}


def _default_said(name: str) -> str:
    """'using the default, 1.0' for a variable that could not be read."""
    value = getattr(Options(), name)
    if value is None:
        said = _UNSET_MEANS.get(name, "unset")
    elif isinstance(value, bool):
        said = "on" if value else "off"
    elif isinstance(value, tuple):
        said = ",".join(value) or "none"
    else:
        said = str(value)
    return f"using the default, {said}"


def resolve(overrides: dict[str, Any], environ: dict[str, str] | None = None) -> Options:
    """Build Options from keyword overrides, then TUNEUP_* variables, then defaults."""
    environ = dict(os.environ) if environ is None else environ
    unknown = sorted(set(overrides) - set(_SPEC))
    if unknown:
        raise ValueError(
            f"tuneup.attach got unknown option {unknown[0]!r}; "
            f"valid options are: {', '.join(sorted(_SPEC))}"
        )
    values: dict[str, Any] = {}
    for name, (env, parse) in _SPEC.items():
        if name in overrides and overrides[name] is not None:
            try:
                values[name] = parse(overrides[name])
            except (TypeError, ValueError) as exc:
                raise ValueError(f"tuneup.attach({name}={overrides[name]!r}): {exc}") from None
        elif env in environ:
            try:
                values[name] = parse(environ[env])
            except ValueError as exc:
                fallback, meaning = _SAFE_FALLBACK.get(name, (None, _default_said(name)))
                if name in _SAFE_FALLBACK:
                    values[name] = fallback
                warn(f"tuneup: ignoring {env}={environ[env]!r} ({exc}); {meaning}")
    return replace(Options(), **values)


def default_run_dir(rank: int | None) -> Path:
    """./tuneup-runs/<time>-<host>-<pid>; under torchrun, the ranks of a node share one
    directory (named after the torchrun agent that started them: its start time and pid), so
    `tuneup report` on it reads every local rank's log."""
    host = socket.gethostname().split(".")[0] or "host"
    if rank is not None and os.environ.get("TORCHELASTIC_RUN_ID") is not None:
        try:
            import psutil

            parent = psutil.Process(os.getppid())
            stamp = time.strftime("%Y%m%d-%H%M%S", time.localtime(parent.create_time()))
            return Path("tuneup-runs") / f"{stamp}-{host}-torchrun{parent.pid}"
        except Exception:
            pass
    stamp = time.strftime("%Y%m%d-%H%M%S")
    suffix = f"-rank{rank}" if rank is not None else ""
    return Path("tuneup-runs") / f"{stamp}-{host}-{os.getpid()}{suffix}"
