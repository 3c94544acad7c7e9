"""Keep secrets out of bundles and logs.

Applied by the agent before anything leaves the rank, and again by the
collector on what it receives (defence in depth: a bundle from an older or
foreign agent is not trusted to be clean).
"""

from __future__ import annotations

import re
from typing import Any

REDACTED = "<redacted>"

# Names whose values are secrets whatever they hold.
_SECRET_NAME = re.compile(
    r"(TOKEN|SECRET|PASSW(OR)?D|PASSPHRASE|CREDENTIAL|API[_-]?KEY|ACCESS[_-]?KEY|PRIVATE[_-]?KEY|"
    r"AUTH|COOKIE|SESSION|SIGNATURE|(^|_)KEY$|_PWD$|^PWD_)",
    re.IGNORECASE,
)
# Names that look secret but are not (kept for debugging value).
_SAFE_NAMES = {"PWD", "OLDPWD", "KEY_PATH", "TORCHELASTIC_ERROR_FILE"}

# Secrets embedded in values: credentials in URLs, bearer tokens, well-known key shapes.
_URL_CREDENTIALS = re.compile(r"(?P<scheme>[a-zA-Z][a-zA-Z0-9+.-]*://)(?P<cred>[^/@\s:]+(:[^/@\s]*)?)@")
_VALUE_PATTERNS = [
    re.compile(r"(?i)\bbearer\s+[A-Za-z0-9._~+/=-]{8,}"),
    re.compile(r"\bhf_[A-Za-z0-9]{20,}"),  # Hugging Face
    re.compile(r"\b(ghp|gho|ghs|ghu|github_pat)_[A-Za-z0-9_]{20,}"),  # GitHub
    re.compile(r"\bAKIA[0-9A-Z]{16}\b"),  # AWS access key id
    re.compile(r"\bsk-[A-Za-z0-9_-]{20,}"),  # OpenAI-style keys
    re.compile(r"\bxox[abprs]-[A-Za-z0-9-]{10,}"),  # Slack
    re.compile(r"(?i)\b(password|passwd|pwd|token|secret|api_key|apikey)=([^\s&;]+)"),
]


def is_secret_name(name: str) -> bool:
    return name.upper() not in _SAFE_NAMES and bool(_SECRET_NAME.search(name))


def redact_text(text: str) -> str:
    text = _URL_CREDENTIALS.sub(lambda m: f"{m.group('scheme')}{REDACTED}@", text)
    for pattern in _VALUE_PATTERNS:
        text = pattern.sub(REDACTED, text)
    return text


def redact_env(env: dict[str, str]) -> dict[str, str]:
    return {k: (REDACTED if is_secret_name(k) else redact_text(v)) for k, v in sorted(env.items())}


def redact_obj(obj: Any) -> Any:
    """Redact every string inside a JSON-like structure (keys named like secrets too)."""
    if isinstance(obj, dict):
        return {k: (REDACTED if isinstance(k, str) and is_secret_name(k) and isinstance(v, str) else redact_obj(v))
                for k, v in obj.items()}
    if isinstance(obj, list):
        return [redact_obj(v) for v in obj]
    if isinstance(obj, str):
        return redact_text(obj)
    return obj
