"""Keep secrets out of everything rankwatch stores or prints.

The rule (SECURITY.md):

1. By name: an environment variable whose name looks secret (``*TOKEN*``,
   ``*SECRET*``, ``*PASSWORD*``, ``*PASSWD*``, ``*PASSPHRASE*``,
   ``*CREDENTIAL*``, ``*API_KEY*``, ``*ACCESS_KEY*``, ``*PRIVATE_KEY*``,
   ``*_KEY``, ``KEY_*``, ``*AUTH*``, ``*COOKIE*``, ``*SESSION*``,
   ``*SIGNATURE*``, ``*_PAT``, ``*_PWD``) has its value replaced in env.json.
2. By value: the value of every such variable (6 characters or more) is
   replaced *wherever it appears*: exception messages, tracebacks, events,
   stacks, argv, bundle members, summaries, the index, the console.
3. By shape: credentials in URLs (``scheme://user:pass@``), bearer
   tokens, ``password=...``-style pairs, and known token shapes (Hugging Face
   ``hf_``, GitHub ``ghp_``/``gho_``/``ghs_``/``ghu_``/``github_pat_``, AWS
   ``AKIA``/``ASIA`` key ids, ``sk-`` keys, Slack ``xox?-``, JWTs, PEM
   private keys).

Applied by the agent before anything leaves the rank (events, bundles), and
again by the collector on what it receives (a bundle from an older or
foreign agent is not trusted to be clean), with the values the collector's
own environment knows. ``register_secret`` adds values known otherwise
(the collector's token).
"""

from __future__ import annotations

import functools
import os
import re
import threading
import time
from typing import Any, Iterable, Mapping, Optional

REDACTED = "<redacted>"
MIN_SECRET_CHARS = 6  # shorter values ("1", "true") would redact ordinary text

# Names whose values are secrets whatever they hold.
_SECRET_NAME = re.compile(
    r"(TOKEN|SECRET|PASSW(OR)?D|PASSPHRASE|CREDENTIAL|API[_-]?KEY|ACCESS[_-]?KEY|PRIVATE[_-]?KEY|"
    r"AUTH|COOKIE|SESSION|SIGNATURE|(^|_)KEY$|^KEY_|_PAT$|_PWD$|^PWD_)",
    re.IGNORECASE,
)
# Names that look secret but are not (kept for debugging value).
_SAFE_NAMES = {"PWD", "OLDPWD", "KEY_PATH", "TORCHELASTIC_ERROR_FILE", "TOKENIZERS_PARALLELISM",
               "SSH_AUTH_SOCK", "XAUTHORITY"}

# Secrets embedded in values: credentials in URLs, bearer tokens, well-known key shapes.
_URL_CREDENTIALS = re.compile(r"(?P<scheme>[a-zA-Z][a-zA-Z0-9+.-]*://)(?P<cred>[^/@\s:]+(:[^/@\s]*)?)@")
_VALUE_PATTERNS = [
    re.compile(r"(?i)\b(bearer|basic)\s+[A-Za-z0-9._~+/=-]{8,}"),
    re.compile(r"\bhf_[A-Za-z0-9]{20,}"),  # Hugging Face
    re.compile(r"\b(ghp|gho|ghs|ghu|ghr|github_pat)_[A-Za-z0-9_]{20,}"),  # GitHub
    re.compile(r"\b(AKIA|ASIA)[0-9A-Z]{16}\b"),  # AWS access key id
    re.compile(r"\bsk-[A-Za-z0-9_-]{20,}"),  # OpenAI-style keys
    re.compile(r"\bxox[abprs]-[A-Za-z0-9-]{10,}"),  # Slack
    re.compile(r"\beyJ[A-Za-z0-9_-]{8,}\.eyJ[A-Za-z0-9_-]{8,}\.[A-Za-z0-9_-]{8,}"),  # JWT
    re.compile(r"-----BEGIN [A-Z ]*PRIVATE KEY-----.*?(-----END [A-Z ]*PRIVATE KEY-----|$)", re.S),
    re.compile(r"(?i)\b(password|passwd|pwd|token|secret|api_key|apikey|access_key|secret_key)"
               r"(\s*[=:]\s*)([^\s&;,'\"]+)"),
]

# One cheap search first: most strings (names, paths, numbers as text) hold
# nothing that any pattern above could match, and skip the substitutions.
_MAYBE = re.compile(r"(?i)://|bearer|basic|hf_|gh[opsur]_|github_pat_|AKIA|ASIA|sk-|xox|eyJ|PRIVATE KEY|"
                    r"passw|pwd|token|secret|api_?key|access_key")

_lock = threading.Lock()
_registered: set[str] = set()
_cache: tuple[float, Optional[re.Pattern]] = (-1e9, None)
_CACHE_SECONDS = 1.0  # the environment is re-read at most once a second


@functools.lru_cache(maxsize=4096)
def is_secret_name(name: str) -> bool:
    return name.upper() not in _SAFE_NAMES and bool(_SECRET_NAME.search(name))


def secret_values(env: Mapping[str, str] = os.environ) -> set[str]:
    """The values of secret-looking variables, long enough to redact safely."""
    out = set()
    for name, value in list(env.items()):
        if is_secret_name(name) and len(value) >= MIN_SECRET_CHARS and value.strip():
            out.add(value)
    return out


def register_secret(value: Optional[str]) -> None:
    """A value to redact wherever it appears (a token not in the environment)."""
    global _cache
    if value and len(value) >= MIN_SECRET_CHARS:
        with _lock:
            _registered.add(value)
            _cache = (-1e9, None)


def _known_values() -> Optional[re.Pattern]:
    global _cache
    now = time.monotonic()
    at, pattern = _cache
    if now - at < _CACHE_SECONDS:
        return pattern
    values = secret_values() | _registered
    # Longest first: a secret that contains another is replaced whole.
    pattern = re.compile("|".join(re.escape(v) for v in sorted(values, key=len, reverse=True))) if values else None
    with _lock:
        _cache = (now, pattern)
    return pattern


def _pair(match: re.Match) -> str:
    return f"{match.group(1)}{match.group(2)}{REDACTED}"


def redact_text(text: str, extra_values: Iterable[str] = ()) -> str:
    if not text:
        return text
    known = _known_values()
    if known is not None:
        text = known.sub(REDACTED, text)
    for value in extra_values:
        if value and len(value) >= MIN_SECRET_CHARS:
            text = text.replace(value, REDACTED)
    if not _MAYBE.search(text):
        return text
    text = _URL_CREDENTIALS.sub(lambda m: f"{m.group('scheme')}{REDACTED}@", text)
    for pattern in _VALUE_PATTERNS[:-1]:
        text = pattern.sub(REDACTED, text)
    return _VALUE_PATTERNS[-1].sub(_pair, text)


def redact_env(env: dict[str, str]) -> dict[str, str]:
    return {k: (REDACTED if is_secret_name(k) else redact_text(v)) for k, v in sorted(env.items())}


def redact_obj(obj: Any) -> Any:
    """Redact every string inside a JSON-like structure (values of keys named
    like secrets entirely)."""
    if isinstance(obj, dict):
        return {(redact_text(k) if isinstance(k, str) else k):
                (REDACTED if isinstance(k, str) and is_secret_name(k) and isinstance(v, str) else redact_obj(v))
                for k, v in obj.items()}
    if isinstance(obj, list):
        return [redact_obj(v) for v in obj]
    if isinstance(obj, tuple):
        return tuple(redact_obj(v) for v in obj)
    if isinstance(obj, str):
        return redact_text(obj)
    return obj


def install_log_redaction() -> None:
    """Redact rankwatch's own log records (messages and tracebacks) as they
    are made. For rankwatch's processes only (the collector, the launcher):
    never installed inside a training process, whose logging is the user's."""
    import logging
    import traceback

    previous = logging.getLogRecordFactory()
    if getattr(previous, "_rankwatch_redacts", False):
        return

    def factory(*args: Any, **kwargs: Any) -> logging.LogRecord:
        record = previous(*args, **kwargs)
        if record.name.startswith("rankwatch"):
            try:
                record.msg, record.args = redact_text(record.getMessage()), ()
                if record.exc_info and record.exc_info[0] is not None:
                    record.exc_text = redact_text("".join(traceback.format_exception(*record.exc_info)).rstrip())
            except Exception:
                pass  # logging must never fail because of redaction
        return record

    factory._rankwatch_redacts = True  # type: ignore[attr-defined]
    logging.setLogRecordFactory(factory)
