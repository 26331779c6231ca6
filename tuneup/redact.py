"""What a user typed, with its secrets hidden before it leaves the process.

The job's argv is recorded (run log header, /api/run, the registry, reports) and options hold
URLs (the Pushgateway's). Before any of it is stored or served, `argv()` and `url()` hide:
- the values of options and assignments whose name looks like a credential, in the forms
  `--name=value`, `--name value` and `name=value` (Hydra-style `a.b.api_key=...` too): a name
  with a part like key, token, secret, password, passwd, pwd, auth..., credential, cookie,
  signature (parts split at `-`, `_`, `.`; `apikey`, `hf_token` count);
- the user information of URLs (`https://user:pass@host` -> `https://<redacted>@host`);
- what the user lists in TUNEUP_REDACT (comma-separated): names of options or variables whose
  values to hide (`--db-dsn,MY_VAR`), and `value:TEXT` entries: TEXT hidden wherever it appears
  (a positional secret, say; 4 characters or more).
Hidden values read `<redacted>`. Over-hiding is the safe side: a value that only looks like a
credential's is hidden too.
"""

from __future__ import annotations

import os
import re
from typing import Iterable

REDACTED = "<redacted>"
_EXACT = frozenset({"key", "keys", "token", "tokens", "secret", "secrets", "password", "passwd", "pwd", "passphrase",
                    "credential", "credentials", "creds", "cookie", "cookies", "signature", "sig", "apikey", "pat"})
_ENDINGS = ("key", "token", "secret", "password", "passwd", "pwd")
_URL_USERINFO = re.compile(r"(?P<scheme>\b[A-Za-z][A-Za-z0-9+.-]*://)(?P<userinfo>[^/@\s?#]+)@")
_ASSIGNMENT = re.compile(r"^(?P<dashes>-{0,2})(?P<name>[A-Za-z_][A-Za-z0-9_.\-]*)=(?P<value>.*)$", re.DOTALL)
_OPTION = re.compile(r"^-{1,2}(?P<name>[A-Za-z][A-Za-z0-9_.\-]*)$")
MIN_LITERAL = 4


def listed(environ: dict[str, str] | None = None) -> tuple[frozenset[str], tuple[str, ...]]:
    """TUNEUP_REDACT's entries: (names, normalized; literal strings)."""
    entries = [entry.strip() for entry in (environ if environ is not None else os.environ).get("TUNEUP_REDACT", "").split(",")]
    names = frozenset(_normal(entry) for entry in entries if entry and not entry.startswith("value:"))
    literals = tuple(entry[len("value:"):] for entry in entries
                     if entry.startswith("value:") and len(entry) - len("value:") >= MIN_LITERAL)
    return names, literals


def _normal(name: str) -> str:
    return name.lstrip("-").lower().replace("-", "_")


def credential_name(name: str, extra: Iterable[str] = ()) -> bool:
    """Whether an option or variable called `name` holds a credential (see the module docstring)."""
    normal = _normal(name)
    if normal in extra:
        return True
    for part in re.split(r"[_.]+", normal):
        if part in _EXACT or part.startswith("auth") or part.endswith(_ENDINGS):
            return True
    return False


def url(text: str) -> str:
    """`text` with the user information of every URL in it hidden."""
    return _URL_USERINFO.sub(lambda match: f"{match['scheme']}{REDACTED}@", text)


def text(value: str, literals: Iterable[str] = ()) -> str:
    """A free-form string: URLs' user information and the listed literals hidden."""
    value = url(value)
    for literal in literals:
        value = value.replace(literal, REDACTED)
    return value


def argv(arguments: Iterable[str], environ: dict[str, str] | None = None) -> list[str]:
    """A command line with its credentials hidden (see the module docstring)."""
    names, literals = listed(environ)
    out: list[str] = []
    hide_next = False
    for argument in (str(a) for a in arguments):
        if hide_next:
            hide_next = False
            if not argument.startswith("-"):
                out.append(REDACTED)
                continue
        assignment = _ASSIGNMENT.match(argument)
        if assignment is not None and credential_name(assignment["name"], names):
            out.append(f"{assignment['dashes']}{assignment['name']}={REDACTED}")
            continue
        option = _OPTION.match(argument)
        if option is not None and credential_name(option["name"], names):
            hide_next = True
        out.append(text(argument, literals))
    return out
