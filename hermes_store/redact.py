"""Mask secrets in exported text: provider tokens of known shapes, passwords in URLs, private
keys, and any value whose key names a secret (JSON, YAML, env, shell flags, HTTP headers).

Used by every export format (``export --redact``). Each secret becomes ``[REDACTED:<kind>]``;
the words around it stay, so a conversation still reads. Two kinds of rule:

* **Shapes**: the token formats of detect-secrets' plugins (AWS, Azure, Basic auth, Cloudant,
  Discord, GitHub, GitLab, IBM, JWT, Mailchimp, npm, OpenAI, PyPI, SendGrid, Slack, Softlayer,
  Square, Stripe, Twilio, Telegram, private keys) and gitleaks' common ones (Anthropic, Google,
  GCP, Hugging Face, Heroku, Shopify, database URLs, AWS session tokens, Azure connection
  strings, bearer tokens), written here so that redaction needs no extra dependency.
* **Key names**: a value under a key that names a secret (``password``, ``PGPASSWORD``,
  ``DB_PASS``, ``client_secret``, ``x-api-key``, ``private_key_id``, ``SessionToken``,
  ``Authorization``, ``Cookie``...) is masked whatever it looks like, in parsed JSON (tool
  arguments and outputs are parsed when they are JSON) and in text (``key: value``,
  ``KEY=value``, ``"key": "value"``, ``--password VALUE``).

Every pattern is bounded (no nested or unbounded repeats that could backtrack), so the work is
linear in the text. ``tests/test_redact*.py`` hold the corpora: realistic secrets, all masked
(with detect-secrets as an oracle), and look-alikes (hashes, UUIDs, ids, prose about
passwords, code that reads a password) that must stay. A secret of no recognisable shape
under no telling key (a bare password in prose) passes: redaction is a safety net.
"""

from __future__ import annotations

import itertools
import json
import re
from collections.abc import Callable
from typing import Any

from hermes_store import jsontext

#: The marker written in place of each secret.
MASK = "[REDACTED:{kind}]"
#: Export records carry this key (true) when they were redacted; ``import`` refuses them.
MARKER_KEY = "redacted"
#: The kind written for a value masked because of its key's name.
KEY_KIND = "secret-assignment"

_PLACEHOLDERS = frozenset(
    {
        "string", "str", "int", "integer", "number", "bool", "boolean", "null", "none", "nil",
        "true", "false", "undefined", "required", "optional", "any", "redacted", "hidden",
        "changeme_later", "example", "your_token", "your_key", "your_password", "password",
        "secret", "token", "xxx", "placeholder", "dummy", "n/a",
    }
)  # fmt: skip
_METAVARIABLE = re.compile(r"[A-Z][A-Z_]{1,40}")
_PLACEHOLDER_STARTS = (
    "<", "${", "{{", "%(", "$", "%", "os.environ", "process.env", "getenv", "env(", "[REDACTED",
)  # fmt: skip


def _looks_random(value: str) -> bool:
    """A token rather than a word: it mixes digits with letters, or cases, or is long."""
    has_digit = any(c.isdigit() for c in value)
    has_alpha = any(c.isalpha() for c in value)
    mixed_case = any(c.isupper() for c in value) and any(c.islower() for c in value)
    return (has_digit and has_alpha) or mixed_case or len(value) >= 32


def _is_placeholder(value: str) -> bool:
    stripped = value.strip().strip("\"'`")
    if not stripped or stripped.lower() in _PLACEHOLDERS:
        return True
    if set(stripped) <= set("*x.X•-_#"):  # ****, xxxx, ...
        return True
    if _METAVARIABLE.fullmatch(stripped):  # VALUE, YOUR_API_KEY, PW
        return True
    return stripped.startswith(_PLACEHOLDER_STARTS)


# -- key names ---------------------------------------------------------------------------------

_SEGMENTS = re.compile(r"[A-Z]?[a-z]+|[A-Z]+(?![a-z])|[0-9]+")
_PASSWORD_WORDS = ("password", "passwd", "passphrase", "passcode")
_PASSWORD_SEGMENTS = frozenset({"pass", "pwd", "pw", "storepass", "keypass", "dbpass", "pgpass"})
#: ``<prefix>_key`` names a credential (``api_key``, ``AccountKey``, ``x-api-key``).
_KEY_PREFIXES = frozenset(
    {
        "api", "access", "secret", "private", "priv", "account", "auth", "client", "service",
        "master", "encryption", "signing", "sign", "shared", "subscription", "app", "db",
        "database", "consumer", "webhook", "license", "storage", "hmac",
    }
)  # fmt: skip
#: A last segment that says the value describes a secret rather than holds it.
_META_SUFFIXES = frozenset(
    {
        "length", "len", "hint", "policy", "field", "fields", "label", "prompt", "required", "min",
        "max", "count", "type", "file", "path", "env", "var", "name", "names", "url", "uri",
        "endpoint", "expiry", "expires", "expiration", "ttl", "format", "mode", "enabled", "set",
        "changed", "reset", "at", "version", "manager", "store", "ref", "arn", "link", "links",
        "stdin", "strength", "rules", "regex", "pattern", "error", "errors", "usage", "limit",
        "limits", "size", "id_type", "header_name", "provider", "kind",
    }
)  # fmt: skip

#: Classes of secret-naming keys.
_STRONG, _TOKEN, _WEAK_KEY, _AUTH, _COOKIE = "strong", "token", "weak-key", "auth", "cookie"


def _key_class(name: str) -> str | None:
    """What a key name says about its value (None: nothing)."""
    segments = [s.lower() for s in _SEGMENTS.findall(name)]
    if not segments:
        return None
    last = segments[-1]
    joined = "".join(segments)
    if joined in ("setcookie", "cookie", "cookies"):
        return _COOKIE
    if last in ("authorization", "auth") and len(segments) <= 3:
        return _AUTH
    if last in _META_SUFFIXES:
        return None
    for seg in segments:
        if seg in _PASSWORD_SEGMENTS or seg.endswith("pwd"):
            return _STRONG
        if any(word in seg for word in _PASSWORD_WORDS):
            return _STRONG
        if "secret" in seg and not seg.startswith("secretar"):
            return _STRONG
        if seg.startswith("credential"):
            return _STRONG
    for before, after in itertools.pairwise(segments):
        if after == "key" and before in _KEY_PREFIXES:
            return _STRONG
    if joined.endswith(("apikey", "accesskey", "privatekey", "secretkey", "accountkey")):
        return _STRONG
    if last.endswith("token") and len(last) <= 16:  # token, accesstoken, authtoken
        return _TOKEN
    if last == "key" or (len(segments) > 1 and last in ("keys", "sig", "signature")):
        return _WEAK_KEY
    return None


_AUTH_SCHEME = re.compile(
    r"(?i)^(basic|bearer|token|digest|negotiate|ntlm|apikey|api-key|key|sso-key|"
    r"aws4-hmac-sha256|hmac|otp|jwt)(\s{1,8})(\S.{0,5000})$",
    re.DOTALL,
)
_COOKIE_ATTRIBUTES = frozenset(
    {
        "path", "domain", "expires", "max-age", "samesite", "secure", "httponly", "priority",
        "partitioned", "version", "comment",
    }
)  # fmt: skip
_TOKEN_CHARS = re.compile(r"[A-Za-z0-9+/=_.~:-]{1,10000}")
_COOKIE_PAIR = re.compile(r"(?<![^;\s])([^=;\s]{1,200})=([^;\s]{1,4000})")


def _mask_cookie(value: str) -> str:
    def pair(match: re.Match[str]) -> str:
        name, content = match.group(1), match.group(2)
        if name.lower() in _COOKIE_ATTRIBUTES or _is_placeholder(content):
            return match.group(0)
        return f"{name}={MASK.format(kind='cookie')}"

    return _COOKIE_PAIR.sub(pair, value)


def _credential_like(value: str) -> bool:
    """A long random token, for keys that only may name a secret (``key``, ``signature``)."""
    if len(value) < 16 or not _TOKEN_CHARS.fullmatch(value):
        return False
    return len(value) >= 32 or _strong_random(value)


def _mask_by_key(key: str, value: str) -> str | None:
    """``value`` masked because ``key`` names a secret, or None when it stays."""
    cls = _key_class(key)
    if cls is None or _is_placeholder(value):
        return None
    if cls == _COOKIE:
        masked = _mask_cookie(value)
        return masked if masked != value else None
    if cls == _AUTH:
        scheme = _AUTH_SCHEME.match(value.strip())
        if scheme and not _is_placeholder(scheme.group(3)):
            kind = "basic-auth" if scheme.group(1).lower() == "basic" else "bearer-token"
            return f"{scheme.group(1)}{scheme.group(2)}{MASK.format(kind=kind)}"
        credential = _looks_random(value) and len(value.strip()) >= 16
        return MASK.format(kind="bearer-token") if credential else None
    if cls == _WEAK_KEY and not _credential_like(value.strip()):
        return None
    if cls in (_TOKEN, _WEAK_KEY) and value.strip().isdigit() and len(value.strip()) < 8:
        return None
    return MASK.format(kind=KEY_KIND)


# -- text rules --------------------------------------------------------------------------------

_B = r"(?<![A-Za-z0-9_-])"  # a token starts here
_E = r"(?![A-Za-z0-9_-])"  # and ends here
_PEM_HEAD = r"-{3,5} ?BEGIN (?:[A-Z0-9]{1,20} ){0,4}PRIVATE KEY(?: BLOCK)? ?-{3,5}"
#: The body of an armored key, headers included; both branches of the rule use the same class,
#: so a header without its END line costs one scan of its body, not one per header.
_PEM_BODY = r"[A-Za-z0-9+/=\s\\:,.()@<>'_-]"
_PEM_TAIL = r"-{3,5} ?END (?:[A-Z0-9]{1,20} ){0,4}PRIVATE KEY(?: BLOCK)? ?-{3,5}"


def _strong_random(value: str) -> bool:
    return (
        any(c.isdigit() for c in value)
        and any(c.isupper() for c in value)
        and any(c.islower() for c in value)
    )


def _not_url_port(value: str) -> bool:
    """``https://host:8080/@user`` has no password: a port and a path come before the ``@``."""
    return not _is_placeholder(value) and re.match(r"\d{1,5}(?:/|$)", value) is None


# (kind, compiled pattern, group holding the secret, predicate on the secret or None)
Rule = tuple[str, re.Pattern[str], int, Callable[[str], bool] | None]
_SHAPES: list[Rule] = [
    (
        "private-key",
        re.compile(rf"({_PEM_HEAD}(?:{_PEM_BODY}{{0,16000}}?{_PEM_TAIL}|{_PEM_BODY}{{0,16000}}))"),
        1,
        None,
    ),
    (
        "private-key",
        re.compile(
            r"(PuTTY-User-Key-File-\d: [^\n]{0,200}\n(?:[^\n]{0,300}\n){0,30}?"
            r"Private-Lines: \d{1,3}\n[A-Za-z0-9+/=\n]{1,10000})"
        ),
        1,
        None,
    ),
    ("anthropic-key", re.compile(rf"{_B}(sk-ant-[A-Za-z0-9_-]{{20,300}})"), 1, None),
    (
        "openai-key",
        re.compile(rf"{_B}(sk-(?:proj-|svcacct-|admin-)?[A-Za-z0-9_-]{{20,300}})"),
        1,
        _looks_random,
    ),
    ("github-token", re.compile(rf"{_B}(gh[pousr]_[A-Za-z0-9_]{{36,255}})"), 1, None),
    ("github-token", re.compile(rf"{_B}(github_pat_[A-Za-z0-9_]{{40,255}})"), 1, None),
    (
        "gitlab-token",
        re.compile(
            rf"{_B}((?:glpat|gldt|glft|glsoat|glrt|glcbt|glimt|glptt|glagent|gloas)-"
            rf"[A-Za-z0-9_-]{{20,1024}}|GR1348941[A-Za-z0-9_-]{{20,50}}){_E}"
        ),
        1,
        None,
    ),
    (
        "aws-access-key",
        re.compile(
            r"(?<![A-Za-z0-9])((?:A3T[A-Z0-9]|ABIA|ACCA|AKIA|ASIA)[0-9A-Z]{16})(?![A-Za-z0-9])"
        ),
        1,
        None,
    ),
    (
        "aws-session-token",
        re.compile(
            r"(?<![A-Za-z0-9/+=])((?:FwoGZXIvYXdz|FQoGZXIvYXdz|IQoJb3JpZ2lu|AQoDYXdz|IQoJ)"
            r"[A-Za-z0-9/+=]{80,4000})"
        ),
        1,
        None,
    ),
    (
        "slack-token",
        re.compile(rf"{_B}((?:xox[abposre]|xapp)(?:\.xox[abposr])?-[A-Za-z0-9-]{{10,300}}){_E}"),
        1,
        None,
    ),
    (
        "webhook-url",
        re.compile(
            r"https://(?:hooks\.slack\.com/(?:services|workflows|triggers)/|"
            r"(?:discord(?:app)?\.com)/api/webhooks/)([A-Za-z0-9/_-]{20,300})"
        ),
        1,
        None,
    ),
    ("google-api-key", re.compile(rf"{_B}(AIza[0-9A-Za-z_-]{{35}}){_E}"), 1, None),
    ("gcp-oauth-secret", re.compile(rf"{_B}(GOCSPX-[A-Za-z0-9_-]{{20,60}}){_E}"), 1, None),
    (
        "stripe-key",
        re.compile(
            rf"{_B}((?:sk|rk)_(?:live|test)_[A-Za-z0-9]{{16,247}}|whsec_[A-Za-z0-9]{{20,}})"
        ),
        1,
        None,
    ),
    (
        "huggingface-token",
        re.compile(rf"{_B}((?:hf_|api_org_)[A-Za-z0-9]{{30,60}}){_E}"),
        1,
        _looks_random,
    ),
    ("npm-token", re.compile(rf"{_B}(npm_[A-Za-z0-9]{{36}}){_E}"), 1, None),
    ("vault-token", re.compile(rf"{_B}(hv[sbr]\.[A-Za-z0-9_-]{{24,500}}){_E}"), 1, None),
    ("pypi-token", re.compile(r"(pypi-AgE[A-Za-z0-9_-]{50,400})"), 1, None),
    ("sendgrid-key", re.compile(r"(SG\.[A-Za-z0-9_-]{22}\.[A-Za-z0-9_-]{43})"), 1, None),
    (
        "square-token",
        re.compile(rf"{_B}(sq0(?:csp|atp|idp)-[0-9A-Za-z\\_-]{{22,60}}|EAAA[A-Za-z0-9_-]{{60}})"),
        1,
        None,
    ),
    ("shopify-token", re.compile(rf"{_B}(shp(?:at|ca|pa|ss)_[a-fA-F0-9]{{32}}){_E}"), 1, None),
    ("heroku-key", re.compile(rf"{_B}(HRKU-[A-Za-z0-9_-]{{20,100}}){_E}"), 1, None),
    ("mailchimp-key", re.compile(r"(?<![0-9a-z])([0-9a-f]{32}-us[0-9]{1,2})(?![0-9])"), 1, None),
    ("twilio-key", re.compile(r"(?<![A-Za-z0-9])((?:AC|SK)[0-9a-f]{32})(?![A-Za-z0-9])"), 1, None),
    (
        "telegram-token",
        re.compile(r"(?:(?<=/bot)|(?<![\w:]))([0-9]{8,10}:[0-9A-Za-z_-]{35})(?![\w-])"),
        1,
        None,
    ),
    (
        "discord-token",
        re.compile(
            rf"{_B}([MNO][A-Za-z0-9_-]{{23,25}}\.[A-Za-z0-9_-]{{6}}\.[A-Za-z0-9_-]{{27,38}}){_E}"
        ),
        1,
        None,
    ),
    (
        "artifactory-key",
        re.compile(r"(?<![A-Za-z0-9])(AKC[a-zA-Z0-9]{10,100})(?![A-Za-z0-9])"),
        1,
        _strong_random,
    ),
    (
        "softlayer-key",
        re.compile(r"api\.softlayer\.com/soap/v3(?:\.1)?/([a-z0-9]{64})"),
        1,
        None,
    ),
    (
        "jwt",
        re.compile(
            rf"{_B}(eyJ[A-Za-z0-9_-]{{8,5000}}\.[A-Za-z0-9_-]{{8,20000}}\.[A-Za-z0-9_-]{{0,5000}})"
        ),
        1,
        None,
    ),
    (
        "azure-sas",
        re.compile(r"(?i)[?&;]sig=([A-Za-z0-9%+/=]{20,200})"),
        1,
        None,
    ),
    (
        # user:password@ in a URL; the password may hold a raw @ or / (or their %40, %2F).
        "url-password",
        re.compile(
            r"\b[a-zA-Z][a-zA-Z0-9+.-]{0,30}://[^\s:/@\"'<>]{0,256}:([^\s\"'<>?#]{1,256})"
            r"@(?=[A-Za-z0-9._~%-]{1,253}(?::[0-9]{1,5})?(?:[/?#\s\"'<>,;)\]]|$))"
        ),
        1,
        _not_url_port,
    ),
    (
        # `aws configure` prompts and `aws configure set NAME VALUE`.
        "aws-secret-key",
        re.compile(
            r"(?i)(?:\bAWS (?:Secret Access Key|Session Token|Access Key ID) ?\[[^\]\n]{0,64}\]:"
            r"[ \t]{0,8}|\baws configure set (?:default\.)?"
            r"(?:aws_secret_access_key|aws_session_token)[ \t]{1,8})([^\s\"']{1,4000})"
        ),
        1,
        lambda v: not _is_placeholder(v),
    ),
    (
        "basic-auth",
        re.compile(
            r"\bcurl\b[^\n]{0,500}?\s(?:-u|--user)[ \t]{1,8}[\"']?[^\s:\"']{1,100}:"
            r"([^\s\"']{1,200})"
        ),
        1,
        lambda v: not _is_placeholder(v),
    ),
    (
        "password",
        re.compile(
            r"\b(?:mysql(?:dump|admin|sh|import|check)?\b[^\n|;&]{0,300}?\s-p(?![ \t])|"
            r"sshpass[ \t]{1,8}-p[ \t]{0,8}|redis-cli\b[^\n|;&]{0,300}?\s-a[ \t]{1,8})"
            r"(\"[^\"\n]{1,200}\"|'[^'\n]{1,200}'|[^\s\"'`,;]{1,200})"
        ),
        1,
        lambda v: not _is_placeholder(v),
    ),
    (
        "password",
        re.compile(
            r"\bmachine[ \t]{1,8}\S{1,200}[ \t]{1,8}login[ \t]{1,8}\S{1,200}[ \t]{1,8}"
            r"password[ \t]{1,8}(\S{1,200})"
        ),
        1,
        None,
    ),
]

_AUTH_HEADER = re.compile(
    r"(?i)(?<![\w-])(?:proxy-)?(authorization|auth)\\?[\"']?[ \t]{0,8}[:=][ \t]{0,8}\\?[\"']?"
    r"(basic|bearer|token|digest|apikey|sso-key|jwt)?([ \t]{0,8})([A-Za-z0-9._~+/:-]{8,5000}=*)"
)
_BEARER = re.compile(r"(?i)\bbearer[ \t]{1,8}([A-Za-z0-9._~+/-]{12,5000}=*)")
_COOKIE_HEADER = re.compile(
    r"(?i)(?<![\w-])((?:set-)?cookie)\\?[\"']?[ \t]{0,8}:[ \t]{0,8}([^\n\"'\r]{1,4000})"
)
_FLAG = re.compile(
    r"(?<![\w-])--?([A-Za-z][A-Za-z0-9_-]{0,60})(?:=|[ \t]{1,8})"
    r"(\"[^\"\n]{1,1000}\"|'[^'\n]{1,1000}'|(?!-)[^\s\"'`;&|<>]{1,1000})"
)
#: A key (holding one of the words a secret-naming key must hold) and its operator.
_KEY_OP = re.compile(
    r"(?<![A-Za-z0-9_.\-])(?P<key>(?=[A-Za-z0-9_.\-]{0,100}?(?i:pass|pwd|pw|secret|credential|"
    r"token|key|auth|cookie|sig))[A-Za-z_][A-Za-z0-9_.\-]{0,100})(?:\\?[\"'`]|\*\*)?"
    r"(?P<op>[ \t]{0,8}(?::=|=>|==|=|:)(?:\*\*)?[ \t]{0,8})"
)
#: The value after a key: matched only once the key names a secret, so text full of
#: ``a: b`` pairs costs one look at each key.
_VALUE = re.compile(
    r"\\\"(?P<esc>[^\n]{1,1000}?)\\\"|\"(?P<dq>(?:[^\"\\\n]|\\.){0,1000})\""
    r"|'(?P<sq>[^'\n]{0,1000})'|`(?P<bq>[^`\n]{1,1000})`|(?P<list>\[[^\]\n]{1,1000}\])"
    r"|(?P<obj>\{[^{}\n]{1,1000}\})"
    r"|(?P<block>[|>][-+]?)(?=[ \t]{0,40}(?:#[^\n]{0,1000})?\n)"
    r"|(?P<bare>[^\s\"'`,;&<>(){}\[\]=][^\s\"'`,;&<>(){}\[\]]{0,999})"
)
#: What may stand before a key at the start of a config line (indent, list bullet, export).
_LINE_PREFIX = re.compile(
    r"[ \t]{0,40}(?:[-*+>][ \t]{1,4}|[0-9]{1,3}[.)][ \t]{1,4}|export[ \t]{1,4})?(?:\*\*|__|[\"'`])?"
)
_COMMENT = re.compile(r"[ \t]#")
_INDENTED = re.compile(r"([ \t]{0,200})([^\n]{0,10000})")
_WORD_BEFORE = re.compile(r"(?<![A-Za-z0-9_-])([A-Za-z]{2,20})[ \t]$")
_QUOTED = re.compile(r"\"(?:[^\"\\\n]|\\.){1,1000}\"|'[^'\n]{1,1000}'")
_QUOTED_VALUE = re.compile(r"(:[ \t]{0,8})(?:\"(?:[^\"\\\n]|\\.){0,1000}\"|'[^'\n]{0,1000}')")
_PROSE_WORD = re.compile(r"[A-Za-z][a-z]{0,20}")
_CODE_REFERENCE = re.compile(r"[a-z_][a-z0-9_]{0,40}(?:\.(?:[a-z_]{1,40}|[A-Z_]{1,40})){1,5}")
#: A bare 40-character token of the AWS secret access key alphabet.
_AWS_SECRET = re.compile(r"(?<![A-Za-z0-9/+=])([A-Za-z0-9/+]{40})(?![A-Za-z0-9/+=])")
_AWS_CONTEXT = re.compile(r"(?i)aws|amazon|secret|credential|access.?key|\bkey\b|\bs3\b|iam")


#: Literals a text must hold (one of) for a kind's rules to run: a fast skip for most text.
_NEEDLES: dict[str, tuple[str, ...]] = {
    "private-key": ("PRIVATE KEY", "PuTTY-User-Key-File"),
    "anthropic-key": ("sk-ant-",),
    "openai-key": ("sk-",),
    "github-token": ("ghp_", "gho_", "ghu_", "ghs_", "ghr_", "github_pat_"),
    "gitlab-token": ("gl", "GR1348941"),
    "aws-access-key": ("A3T", "ABIA", "ACCA", "AKIA", "ASIA"),
    "aws-session-token": ("FwoGZXIvYXdz", "FQoGZXIvYXdz", "IQoJ", "AQoDYXdz"),
    "slack-token": ("xox", "xapp-"),
    "webhook-url": ("hooks.slack.com/", "/api/webhooks/"),
    "google-api-key": ("AIza",),
    "gcp-oauth-secret": ("GOCSPX-",),
    "stripe-key": ("_live_", "_test_", "whsec_"),
    "huggingface-token": ("hf_", "api_org_"),
    "npm-token": ("npm_",),
    "vault-token": ("hvs.", "hvb.", "hvr."),
    "pypi-token": ("pypi-AgE",),
    "sendgrid-key": ("SG.",),
    "square-token": ("sq0", "EAAA"),
    "shopify-token": ("shpat_", "shpca_", "shppa_", "shpss_"),
    "heroku-key": ("HRKU-",),
    "mailchimp-key": ("-us",),
    "twilio-key": ("AC", "SK"),
    "telegram-token": (":",),
    "discord-token": (".",),
    "artifactory-key": ("AKC",),
    "softlayer-key": ("softlayer.com",),
    "jwt": ("eyJ",),
    "azure-sas": ("sig=",),
    "url-password": ("://",),
    "aws-secret-key": ("aws ",),
    "basic-auth": ("curl",),
    "password": ("mysql", "sshpass", "redis-cli", "machine"),
}


def _mask(kind: str) -> str:
    return MASK.format(kind=kind)


def _apply(rule: Rule, text: str) -> str:
    kind, pattern, group, accept = rule

    def replace(match: re.Match[str]) -> str:
        secret = match.group(group)
        if accept is not None and not accept(secret):
            return match.group(0)
        start, end = match.span(group)
        offset = match.start()
        whole = match.group(0)
        return whole[: start - offset] + _mask(kind) + whole[end - offset :]

    return pattern.sub(replace, text)


def _auth_headers(text: str) -> str:
    def header(match: re.Match[str]) -> str:
        scheme, value = match.group(2), match.group(4)
        if _is_placeholder(value) or (scheme is None and not _looks_random(value)):
            return match.group(0)
        kind = "basic-auth" if (scheme or "").lower() == "basic" else "bearer-token"
        return match.group(0)[: match.start(4) - match.start()] + _mask(kind)

    def bearer(match: re.Match[str]) -> str:
        value = match.group(1)
        if not _looks_random(value) or _is_placeholder(value):
            return match.group(0)
        return match.group(0)[: match.start(1) - match.start()] + _mask("bearer-token")

    def cookie(match: re.Match[str]) -> str:
        cut = match.start(2) - match.start()
        return match.group(0)[:cut] + _mask_cookie(match.group(2))

    text = _AUTH_HEADER.sub(header, text)
    text = _BEARER.sub(bearer, text)
    return _COOKIE_HEADER.sub(cookie, text)


def _flags(text: str) -> str:
    """``--password VALUE`` and ``--api-key=VALUE``."""

    def _prose(value: str, end: int) -> bool:
        return (
            _PROSE_WORD.fullmatch(value) is not None and text[end : end + 40].lstrip()[:1].isalpha()
        )

    def flag(match: re.Match[str]) -> str:
        cls = _key_class(match.group(1))
        value = match.group(2)
        if cls not in (_STRONG, _TOKEN) or _is_placeholder(value) or _prose(value, match.end()):
            return match.group(0)
        return match.group(0)[: match.start(2) - match.start()] + _mask(KEY_KIND)

    return _FLAG.sub(flag, text)


def _block_scalar(text: str, match: re.Match[str], end: int) -> tuple[str | None, int, int]:
    """A YAML block scalar (``password: |``): the more indented lines below are the value."""
    line_start = text.rfind("\n", max(0, match.start() - 200), match.start()) + 1
    indent = match.start() - line_start
    start = line_end = text.find("\n", end)
    stop = -1
    for _ in range(500):
        if line_end < 0:
            break
        following = _INDENTED.match(text, line_end + 1)
        blank = following is not None and not following.group(2).strip()
        if following is None or (len(following.group(1)) <= indent and not blank):
            break
        stop = stop if blank else following.end()
        line_end = following.end() if text.startswith("\n", following.end()) else -1
    if stop < 0:
        return None, start, start
    return "\n" + " " * (indent + 2) + _mask(KEY_KIND), start, stop


def _masked_value(
    text: str, match: re.Match[str], found: re.Match[str], key: str, cls: str
) -> tuple[str | None, int, int]:
    """The mask for the value ``found`` after ``match`` (key and operator), and its span."""
    kind_of_value = found.lastgroup or "bare"
    value = found.group(kind_of_value)
    start, end = found.span(kind_of_value)
    op = match.group("op")
    if kind_of_value in ("list", "obj"):
        # Every string of a list, every value of a flat object, under a key naming a secret.
        if kind_of_value == "list":
            listed = _QUOTED.sub(_mask(KEY_KIND), value)
        else:
            listed = _QUOTED_VALUE.sub(lambda m: m.group(1) + _mask(KEY_KIND), value)
        return (listed if cls == _STRONG and listed != value else None), start, end
    if kind_of_value == "bq" and op == op.rstrip():
        return None, start, end  # `password=`/`...`: a code span closing, not a quoted value
    if kind_of_value == "block":
        return _block_scalar(text, match, end)
    masked = _mask_by_key(key, value)
    if masked is None or kind_of_value != "bare":
        return masked, start, end
    if text[end : end + 1] in ("(", "[") or _CODE_REFERENCE.fullmatch(value):
        return None, start, end  # code: password = get_password()
    colon = ":" in op and ":=" not in op
    # Looked for only a little way back: a long line must not make this quadratic.
    low = max(0, match.start() - 64)
    line_start = text.rfind("\n", low, match.start()) + 1 or (0 if low == 0 else -1)
    config_line = (
        (colon or op != op.strip())
        and line_start >= 0
        and _LINE_PREFIX.fullmatch(text, line_start, match.start()) is not None
    )
    if config_line:
        # YAML / INI: the value runs to the end of the line (or to a comment).
        line_end = text.find("\n", end)
        line_end = len(text) if line_end < 0 else line_end
        comment = _COMMENT.search(text, end, line_end)
        cut = line_end if comment is None else comment.start()
        end = cut - (len(text[end:cut]) - len(text[end:cut].rstrip()))
        return _mask_by_key(key, text[start:end]), start, end
    if colon and _PROSE_WORD.fullmatch(value) and text[end : end + 80].lstrip()[:1].isalpha():
        return None, start, end  # prose: "your password: check your inbox"
    return masked, start, end


def _key_values(text: str) -> str:
    """``key: value``, ``KEY=value``, ``"key": "value"`` where the key names a secret.

    A key that names nothing is stepped over (not its value), so ``note: password=x`` is seen.
    """
    out: list[str] = []
    pos = 0
    while True:
        match = _KEY_OP.search(text, pos)
        if match is None:
            break
        key = match.group("key")
        cls = _key_class(key)
        if cls in (None, _WEAK_KEY):
            # "API key: ...", "Access token = ...": the word before may complete the name.
            before = _WORD_BEFORE.search(text, max(0, match.start() - 24), match.start())
            if before is not None:
                key = f"{before.group(1)}_{key}"
                cls = _key_class(key)
        found = None if cls is None else _VALUE.match(text, match.end())
        masked: str | None = None
        start = end = 0
        if found is not None and cls is not None:
            masked, start, end = _masked_value(text, match, found, key, cls)
        if masked is None:
            out.append(text[pos : match.end("key")])
            pos = match.end("key")
            continue
        out.append(text[pos:start])
        out.append(masked)
        pos = end
    out.append(text[pos:])
    return "".join(out)


def _aws_secrets(text: str) -> str:
    """A bare 40-character mixed-case token: an AWS secret key unless it reads like a path."""

    def secret(match: re.Match[str]) -> str:
        value = match.group(1)
        if not (_strong_random(value) or ("+" in value and _looks_random(value))):
            return value
        pathlike = any(
            re.fullmatch(r"[a-z]{2,}|[A-Z]?[a-z]{2,}(?:[A-Z][a-z]{1,})*", part)
            for part in value.split("/")
        ) if "/" in value else False  # fmt: skip
        if pathlike and not _AWS_CONTEXT.search(text, max(0, match.start() - 200), match.start()):
            return value
        return _mask("aws-secret-key")

    return _AWS_SECRET.sub(secret, text)


def redact_text(text: str) -> str:
    """``text`` with every recognised secret replaced by ``[REDACTED:<kind>]``."""
    folded = text.lower()
    for rule in _SHAPES:
        haystack = folded if rule[1].flags & re.IGNORECASE else text
        if any(needle in haystack for needle in _NEEDLES[rule[0]]):
            text = _apply(rule, text)
    if any(word in folded for word in ("auth", "bearer", "cookie")):
        text = _auth_headers(text)
    if "-" in text:
        text = _flags(text)
    if ":" in text or "=" in text:
        text = _key_values(text)
    return _aws_secrets(text)


def _mask_all(value: Any) -> Any:
    """Every string inside a value whose key names a secret (a list of keys, a nested dict)."""
    if isinstance(value, str):
        return value if _is_placeholder(value) else _mask(KEY_KIND)
    if isinstance(value, list):
        return [_mask_all(item) for item in value]
    if isinstance(value, dict):
        return {key: _mask_all(item) for key, item in value.items()}
    return value


def redact_value(value: Any) -> Any:
    """Redact every string inside ``value`` (dicts, lists, and JSON held in strings).

    A dict value under a key that names a secret is masked whole, whatever its shape.
    """
    if isinstance(value, str):
        stripped = value.lstrip()
        if stripped[:1] in ("{", "[") and len(stripped) > 1:
            try:
                parsed = json.loads(value)
            except ValueError:
                return redact_text(value)
            cleaned = redact_value(parsed)
            return value if cleaned == parsed else jsontext.dumps(cleaned, ensure_ascii=False)
        return redact_text(value)
    if isinstance(value, dict):
        out: dict[Any, Any] = {}
        for key, item in value.items():
            if isinstance(key, str) and isinstance(item, str):
                masked = _mask_by_key(key, item)
                out[key] = masked if masked is not None else redact_value(item)
            elif (
                isinstance(key, str)
                and isinstance(item, list | dict)
                and _key_class(key) == _STRONG
            ):
                out[key] = _mask_all(item)
            else:
                out[key] = redact_value(item)
        return out
    if isinstance(value, list):
        return [redact_value(item) for item in value]
    if isinstance(value, bytes | bytearray | memoryview):
        # A blob a file the original store wrote may hold text: a secret in it is masked
        # too (the blob then comes out as the text, redacted), not carried out in base64.
        raw = bytes(value)
        text = raw.decode("utf-8", errors="replace")
        cleaned = redact_value(text)
        return raw if cleaned == text else cleaned
    return value


#: Columns that identify or classify rather than hold free text: never rewritten, so a
#: redacted export still links messages to sessions and imports (with --force) consistently.
STRUCTURAL_KEYS = frozenset(
    {"id", "session_id", "parent_session_id", "source", "role", "model", "tool_call_id",
     "tool_name", "finish_reason", "end_reason", "cost_status", "cost_source",
     "pricing_version", "billing_mode", "billing_provider"}
)  # fmt: skip


def redact_record(record: dict[str, Any]) -> dict[str, Any]:
    """An exported session (row and ``messages``) with its free text redacted and marked."""
    out: dict[str, Any] = {}
    for key, value in record.items():
        if key == "messages" and isinstance(value, list):
            out[key] = [
                {k: v if k in STRUCTURAL_KEYS else redact_value(v) for k, v in m.items()}
                for m in value
            ]
        elif key in STRUCTURAL_KEYS:
            out[key] = value
        else:
            out[key] = redact_value(value)
    out[MARKER_KEY] = True
    return out
