"""``export --redact`` against a corpus of realistic secrets, through a real SQLite store and
both export formats, with detect-secrets as an oracle; look-alikes stay readable."""

from __future__ import annotations

import contextlib
import json
import re
from pathlib import Path
from typing import Any

import pytest
from click.testing import CliRunner

from hermes_store import SessionDB
from hermes_store.cli import cli
from hermes_store.redact import redact_text, redact_value
from tests.support.redact_corpus import LOOK_ALIKES, SECRETS, Secret


def _store_with(path: Path, samples: list[tuple[str, str]]) -> None:
    """One session per sample; the sample in every free-text place a message has."""
    with SessionDB(path) as store:
        for name, text in samples:
            sid = f"s-{name}"
            store.create_session(sid, "cli")
            store.append_message(sid, "user", text)
            store.append_message(
                sid,
                "assistant",
                None,
                tool_calls=[
                    {
                        "id": "call_1",
                        "type": "function",
                        "function": {"name": "terminal", "arguments": json.dumps({"input": text})},
                    }
                ],
                reasoning=f"The user pasted this, I should not repeat it:\n{text}",
            )
            store.append_message(sid, "tool", f"$ cat notes\n{text}\n", tool_call_id="call_1")
            store.append_message(
                sid, "tool", json.dumps({"stdout": text, "exit_code": 0}), tool_call_id="call_1"
            )


def _export(db: Path, out: Path, fmt: str, *extra: str) -> str:
    result = CliRunner().invoke(
        cli, ["--db", str(db), "export", "--redact", "--format", fmt, *extra, "-o", str(out)]
    )
    assert result.exit_code == 0, result.output
    return out.read_text(encoding="utf-8")


def _strings(value: Any) -> list[str]:
    """Every string inside an exported record, JSON held in strings decoded too."""
    if isinstance(value, str):
        found = [value]
        if value.lstrip()[:1] in ("{", "["):
            with contextlib.suppress(ValueError):
                found += _strings(json.loads(value))
        return found
    if isinstance(value, dict):
        return [s for item in value.values() for s in _strings(item)]
    if isinstance(value, list):
        return [s for item in value for s in _strings(item)]
    return []


#: The secret types of detect-secrets' default plugins that the corpus must exercise (all but
#: the public-IP plugin, which finds addresses, not secrets).
DETECT_SECRETS_PLUGINS = {
    "AWS Access Key", "Artifactory Credentials", "Azure Storage Account access key",
    "Base64 High Entropy String", "Basic Auth Credentials", "Cloudant Credentials",
    "Discord Bot Token", "GitHub Token", "GitLab Token", "Hex High Entropy String",
    "IBM COS HMAC Credentials", "IBM Cloud IAM Key", "JSON Web Token", "Mailchimp Access Key",
    "NPM tokens", "OpenAI Token", "Private Key", "PyPI Token", "Secret Keyword",
    "SendGrid API Key", "Slack Token", "SoftLayer Credentials", "Square OAuth Secret",
    "Stripe Access Key", "Telegram Bot Token", "Twilio API Key",
}  # fmt: skip


@pytest.fixture(scope="module")
def exports(tmp_path_factory: pytest.TempPathFactory) -> dict[str, str]:
    """The redacted exports of the whole secret corpus: JSON Lines and Markdown."""
    folder = tmp_path_factory.mktemp("redact-corpus")
    db = folder / "state.db"
    _store_with(db, [(s.name, s.text) for s in SECRETS])
    jsonl = _export(db, folder / "all.jsonl", "jsonl")
    views = {"jsonl": jsonl, "md": _export(db, folder / "all.md", "md")}
    decoded = [s for line in jsonl.splitlines() for s in _strings(json.loads(line))]
    views["jsonl decoded"] = "\n".join(decoded)
    return views


@pytest.mark.unit
def test_the_corpus_is_large_and_each_secret_is_distinct() -> None:
    assert len(SECRETS) >= 60
    assert len({s.name for s in SECRETS}) == len(SECRETS)
    for secret in SECRETS:
        for part in secret.parts:
            assert part in secret.text, secret.name
            assert len(part) >= 6, secret.name


@pytest.mark.unit
@pytest.mark.parametrize("secret", SECRETS, ids=[s.name for s in SECRETS])
def test_no_secret_survives_either_export(secret: Secret, exports: dict[str, str]) -> None:
    for view, text in exports.items():
        for part in secret.parts:
            where = text.find(part)
            assert where < 0, (view, part, text[max(0, where - 120) : where + 120])


@pytest.mark.unit
def test_redacted_exports_stay_marked_and_readable(exports: dict[str, str]) -> None:
    assert all(json.loads(line)["redacted"] is True for line in exports["jsonl"].splitlines())
    assert "Redacted export" in exports["md"]
    assert len(re.findall(r"\[REDACTED:(?!kind\])", exports["md"])) >= 5 * len(SECRETS)
    # The words around the secrets stay.
    for words in ("mongodump --host mongo.internal --username admin --password", "the CI variables",
                  "Default region name [None]: eu-west-1", "hermes-prod-381204"):  # fmt: skip
        assert words in exports["md"], words


@pytest.mark.unit
def test_detect_secrets_finds_nothing_left(tmp_path: Path, exports: dict[str, str]) -> None:
    """The oracle: whatever detect-secrets' default plugins flag in a sample is gone."""
    from detect_secrets import SecretsCollection
    from detect_secrets.settings import default_settings

    flagged: dict[str, set[str]] = {}
    plugins: set[str] = set()
    with default_settings():
        for secret in SECRETS:
            sample = tmp_path / f"{secret.name}.txt"
            sample.write_text(secret.text + "\n", encoding="utf-8")
            found = SecretsCollection()
            found.scan_file(str(sample))
            for potential in found[str(sample)]:
                plugins.add(potential.type)
                value = (potential.secret_value or "").strip()
                if len(value) >= 6:  # the keyword plugin may take a short word
                    flagged.setdefault(secret.name, set()).add(value)
    assert len(flagged) >= 55, sorted(flagged)  # the oracle sees most of the corpus...
    assert plugins >= DETECT_SECRETS_PLUGINS, DETECT_SECRETS_PLUGINS - plugins  # ...every kind
    unescaped = exports["md"].replace('\\"', '"').replace("\\\\", "\\")
    leaks = [
        (name, value, view)
        for name, values in flagged.items()
        for value in values
        for view, text in (*exports.items(), ("md unescaped", unescaped))
        if value in text
    ]
    assert not leaks


@pytest.mark.unit
def test_look_alikes_come_out_unchanged(tmp_path: Path) -> None:
    db = tmp_path / "state.db"
    _store_with(db, [(f"n{i}", text) for i, text in enumerate(LOOK_ALIKES)])
    jsonl = _export(db, tmp_path / "all.jsonl", "jsonl")
    markdown = _export(db, tmp_path / "all.md", "md")
    with SessionDB(db) as store:
        originals = {r["id"]: r for r in store.iter_export()}
    assert len(originals) == len(LOOK_ALIKES)
    for line in jsonl.splitlines():
        record = json.loads(line)
        original = originals[record["id"]]
        for got, want in zip(record["messages"], original["messages"], strict=True):
            for key in ("content", "reasoning", "tool_calls"):
                assert got[key] == want[key], (record["id"], key, got[key])
    for text in LOOK_ALIKES:
        assert text in markdown, text
    assert "[REDACTED:" not in jsonl
    assert re.search(r"\[REDACTED:(?!kind\])", markdown) is None


@pytest.mark.unit
@pytest.mark.parametrize("text", LOOK_ALIKES, ids=[t[:30] for t in LOOK_ALIKES])
def test_each_look_alike_is_left_alone(text: str) -> None:
    assert redact_text(text) == text
    assert redact_value(json.dumps({"input": text})) == json.dumps({"input": text})


@pytest.mark.unit
def test_a_value_under_a_secret_key_is_masked_whatever_it_looks_like() -> None:
    masked = redact_value(
        {"password": "hunter", "db": {"DB_PASS": "x1"}, "apiKey": "plain", "max_tokens": 9,
         "token_count": "12", "password_hint": "pet name", "Authorization": "Basic Zm9v"}
    )  # fmt: skip
    assert masked == {
        "password": "[REDACTED:secret-assignment]",
        "db": {"DB_PASS": "[REDACTED:secret-assignment]"},
        "apiKey": "[REDACTED:secret-assignment]",
        "max_tokens": 9,
        "token_count": "12",
        "password_hint": "pet name",
        "Authorization": "Basic [REDACTED:basic-auth]",
    }


def test_ten_megabyte_message_redacts_in_linear_time() -> None:
    """Bounded patterns: 10 MB of adversarial text on one line (long runs of key and token
    characters, many near-misses) redacts, and the secrets in it are found. Integration tier:
    it takes seconds."""
    chunk = (
        "a" * 5000 + " password: " + "x-" * 3000 + " postgres://u:" + "p" * 4000 + " "
        + "-----BEGIN RSA PRIVATE KEY-----" + "A" * 100 + " eyJ" + "b" * 3000 + "."
        + " sk-" + "c" * 500 + " AKIA" + "D" * 300 + ' "token": "' + "e" * 2000
        + ' PGPASSWORD=Hunter2x9 ' + "/" * 3000 + " password: x1 api_key = y2 "
    )  # fmt: skip
    text = chunk * (10_000_000 // len(chunk) + 1)
    out = redact_text(text)
    assert "Hunter2x9" not in out
    assert re.search(r"PGPASSWORD=\[REDACTED:", out)
