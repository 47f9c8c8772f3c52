# ruff: noqa: E501  (the corpora keep each sample on one line, as it would appear)
"""Redaction masks every secret of a realistic corpus and nothing in a corpus of look-alikes."""

from __future__ import annotations

import base64
import json
import sqlite3
from contextlib import closing
from pathlib import Path

import pytest

from hermes_store import SessionDB, transfer
from hermes_store.redact import redact_record, redact_text, redact_value

# (text, the secret inside it). Fake values with the real shapes.
SECRETS = [
    (
        "export OPENAI_API_KEY=sk-proj-Xq3vT9aLm2Rk8sPz4YwB7nC1dE5fG6hJ0kL",
        "sk-proj-Xq3vT9aLm2Rk8sPz4YwB7nC1dE5fG6hJ0kL",
    ),
    (
        "key: sk-4fGh7Jk9Lm2Np5Qr8St1Uv3Wx6Yz0AbCdEfGhIj",
        "sk-4fGh7Jk9Lm2Np5Qr8St1Uv3Wx6Yz0AbCdEfGhIj",
    ),
    (
        "ANTHROPIC_API_KEY='sk-ant-api03-AbCdEf123456_ghIJkl-789MNopQRstu'",
        "sk-ant-api03-AbCdEf123456_ghIJkl-789MNopQRstu",
    ),
    (
        "git remote set-url origin https://ghp_16C7e42F292c6912E7710c838347Ae178B4a@github.com/o/r.git",
        "ghp_16C7e42F292c6912E7710c838347Ae178B4a",
    ),
    (
        "token github_pat_11ABCDEFG0123456789_abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUV",
        "github_pat_11ABCDEFG0123456789_abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUV",
    ),
    ("[default]\naws_access_key_id = AKIAIOSFODNN7EXAMPLE\n", "AKIAIOSFODNN7EXAMPLE"),
    (
        "aws_secret_access_key = wJalrXUtnFEMI/K7MDENG/bPxRfiCYEXAMPLEKEY",
        "wJalrXUtnFEMI/K7MDENG/bPxRfiCYEXAMPLEKEY",
    ),
    (
        "curl -H 'Authorization: Bearer eyJhbGciOiJIUzI1NiJ9.eyJzdWIiOiIxMjM0NTY3ODkwIn0.dozjgNryP4J3jVmNHl0w5N_XgL0n3I9PlFUP0THsR8U' https://api.x.io",
        "eyJhbGciOiJIUzI1NiJ9.eyJzdWIiOiIxMjM0NTY3ODkwIn0.dozjgNryP4J3jVmNHl0w5N_XgL0n3I9PlFUP0THsR8U",
    ),
    (
        'headers = {"Authorization": "Bearer 9f8e7d6c5b4a39281706f5e4d3c2b1a0"}',
        "9f8e7d6c5b4a39281706f5e4d3c2b1a0",
    ),
    ("Authorization: Basic dXNlcjpodW50ZXIyMjI=", "dXNlcjpodW50ZXIyMjI="),
    ("DATABASE_URL=postgresql://hermes:S3cr3t-Pa55@db.internal:5432/hermes", "S3cr3t-Pa55"),
    ("mongodb+srv://admin:hunter2hunter2@cluster0.abcde.mongodb.net/test", "hunter2hunter2"),
    ("redis://:p4ssw0rd@localhost:6379/0", "p4ssw0rd"),
    ('{"password": "correct horse"}', "correct horse"),
    ('db.connect(user="app", password="Tr0ub4dor&3")', "Tr0ub4dor&3"),
    ("PASSWORD=hunter22 ./run.sh", "hunter22"),
    (
        "client_secret: 8Q~aBcD3fGhIjKlMnOpQrStUvWxYz0123456789",
        "8Q~aBcD3fGhIjKlMnOpQrStUvWxYz0123456789",
    ),
    (
        "SLACK_BOT_TOKEN=xoxb-123456789012-1234567890123-AbCdEfGhIjKlMnOpQrStUvWx",
        "xoxb-123456789012-1234567890123-AbCdEfGhIjKlMnOpQrStUvWx",
    ),
    (
        "post to https://hooks.slack.com/services/T00000000/B00000000/XXXXXXXXXXXXXXXXXXXXXXXX",
        "T00000000/B00000000/XXXXXXXXXXXXXXXXXXXXXXXX",
    ),
    (
        "maps key AIzaSyD-9tSrke72PouQMnMX-a7eZSW0jkFMBWY in the config",
        "AIzaSyD-9tSrke72PouQMnMX-a7eZSW0jkFMBWY",
    ),
    ("stripe.api_key = 'sk_live_4eC39HqLyjWDarjtT1zdp7dc'", "sk_live_4eC39HqLyjWDarjtT1zdp7dc"),
    ("HF_TOKEN=hf_aBcDeFgHiJkLmNoPqRsTuVwXyZ0123456789", "hf_aBcDeFgHiJkLmNoPqRsTuVwXyZ0123456789"),
    (
        "//registry.npmjs.org/:_authToken=npm_aBcDeFgHiJkLmNoPqRsTuVwXyZ0123456789",
        "npm_aBcDeFgHiJkLmNoPqRsTuVwXyZ0123456789",
    ),
    (
        "-----BEGIN OPENSSH PRIVATE KEY-----\nb3BlbnNzaC1rZXktdjEAAAAABG5vbmUAAAAEbm9uZQAAAAAAAAABAAAAMwAAAAtzc2gtZW\nQyNTUxOQAAACD3x2Gm8kq\n-----END OPENSSH PRIVATE KEY-----",
        "b3BlbnNzaC1rZXktdjEAAAAABG5vbmUAAAAEbm9uZQAAAAAAAAABAAAAMwAAAAtzc2gtZW",
    ),
    (
        "here it is: -----BEGIN RSA PRIVATE KEY-----\nMIIEowIBAAKCAQEA7bq9Xw3x\nQyNTUxOQAAACD3",
        "MIIEowIBAAKCAQEA7bq9Xw3x",
    ),
    ('api_key: "a1b2c3d4e5f6a7b8c9d0"', "a1b2c3d4e5f6a7b8c9d0"),
    ("export GITLAB_TOKEN=glpat-AbCdEf1234567890XyZw", "glpat-AbCdEf1234567890XyZw"),
]

LOOK_ALIKES = [
    "pip install scikit-learn  # the sk-learn package",
    "The task-force met at 10; see ask-me-anything-about-databases-and-sqlite-here.",
    "max_tokens=2048, token_count = 42, input_tokens: 1200",
    "The password is required; enter it when prompted.",
    "password: ******** (hidden)",
    "password: <your password>",
    "api_key=os.environ['OPENAI_API_KEY']",
    "token = getenv('TOKEN')",
    "def login(user: str, password: str) -> None: ...",
    "interface Props { token: string; secret: boolean }",
    "Bearer of bad news: the deploy failed.",
    "Use bearer authentication for the gateway.",
    "git checkout 3f786850e387550fdab836ed7e6dc881de23001b",
    "session 7f3c9a2e-1b4d-4c8e-9f2a-0d1e2f3a4b5c ended",
    "https://user@example.com/path and ssh://git@github.com:22/org/repo.git",
    "http://localhost:8080/api?x=1 and postgresql://hermes@localhost/hermes",
    "-----BEGIN PUBLIC KEY-----\nMFkwEwYHKoZIzj0CAQYIKoZIzj0DAQcDQgAE\n-----END PUBLIC KEY-----",
    "-----BEGIN CERTIFICATE-----\nMIIDdzCCAl+gAwIBAgIEAgAAuTANBgkqhkiG9w0BAQUFADBa\n-----END CERTIFICATE-----",
    "AKIA is a prefix; AKIAshort is not a key.",
    "The secret to good soup is salt.",
    "reset_password_link sent; passwords must be 12+ chars",
    "sk-1 and sk-2 are shard keys",
    "Email me at alice@example.com or call +1 555 0100.",
    "数据库迁移完成了 🚀 token bucket refill rate=5/s",
    "eyJhbGciOiJIUzI1NiJ9 alone is just a JWT header",
    "Codename: zebracorn. All \"quotes\" and 'apostrophes' kept.",
]


@pytest.mark.parametrize(("text", "secret"), SECRETS, ids=[s[:30] for s, _ in SECRETS])
def test_every_realistic_secret_is_masked(text: str, secret: str) -> None:
    redacted = redact_text(text)
    assert secret not in redacted, redacted
    assert "[REDACTED:" in redacted


@pytest.mark.parametrize("text", LOOK_ALIKES, ids=[t[:30] for t in LOOK_ALIKES])
def test_look_alikes_are_left_alone(text: str) -> None:
    assert redact_text(text) == text


def test_the_words_around_a_secret_stay() -> None:
    text = "connect with postgresql://hermes:S3cr3t-Pa55@db:5432/x then run"
    assert redact_text(text) == (
        "connect with postgresql://hermes:[REDACTED:url-password]@db:5432/x then run"
    )


def test_secrets_inside_json_strings_are_masked_and_the_json_stays_valid() -> None:
    arguments = json.dumps(
        {"command": "curl -H 'Authorization: Bearer 9f8e7d6c5b4a39281706f5e4d3c2b1a0' x"}
    )
    calls = [
        {"id": "c1", "type": "function", "function": {"name": "terminal", "arguments": arguments}}
    ]
    cleaned = redact_value(calls)
    inner = json.loads(cleaned[0]["function"]["arguments"])
    assert "9f8e7d6c5b4a" not in inner["command"] and "[REDACTED:bearer-token]" in inner["command"]
    assert cleaned[0]["id"] == "c1"


def test_a_redacted_record_is_marked_and_keeps_its_structure() -> None:
    record = {
        "id": "s1",
        "source": "cli",
        "system_prompt": "use key sk-proj-Xq3vT9aLm2Rk8sPz4YwB7nC1dE5fG6hJ0kL",
        "messages": [{"id": 1, "session_id": "s1", "role": "user", "content": "PASSWORD=hunter22"}],
    }
    out = redact_record(record)
    assert out["redacted"] is True
    assert out["id"] == "s1" and out["messages"][0]["session_id"] == "s1"
    assert "sk-proj" not in out["system_prompt"]
    assert out["messages"][0]["content"] == "PASSWORD=[REDACTED:secret-assignment]"


def test_a_secret_in_a_blob_is_masked_not_carried_out_in_base64(tmp_path: Path) -> None:
    """A file the original store wrote may hold a blob where text belongs. A redacted export
    wrote a blob as its bytes in base64, which no rule looks into: the secret left the
    machine encoded. The blob's text is redacted like any other; a blob without a secret
    stays the blob it was."""
    secret = "sk-proj-Xq3vT9aLm2Rk8sPz4YwB7nC1dE5fG6hJ0kL"
    path = tmp_path / "state.db"
    with SessionDB(path) as store:
        store.create_session("s1", "cli")
        store.append_message("s1", "user", "placeholder")
        store.append_message("s1", "user", "placeholder")
    with closing(sqlite3.connect(path)) as raw, raw:
        raw.execute(
            "UPDATE messages SET content = ? WHERE id = 1", (f"OPENAI_API_KEY={secret}".encode(),)
        )
        raw.execute("UPDATE messages SET content = ? WHERE id = 2", (b"\x00\xffplain",))
    out = tmp_path / "out.jsonl"
    with SessionDB(path) as store:
        records, _ = transfer.export_records(store)
        transfer.write_records(records, str(out), store.engine.url, redacted=True)
    written = out.read_text()
    assert secret not in written
    assert base64.b64encode(secret.encode()).decode()[:20] not in written
    (record,) = [json.loads(line) for line in written.splitlines()]
    first, second = record["messages"]
    assert first["content"].startswith("OPENAI_API_KEY=[REDACTED")
    assert second["content"] == {
        "$sqlite": "blob",
        "base64": base64.b64encode(b"\x00\xffplain").decode(),
    }
    assert redact_value(b"no secret here") == b"no secret here"
