# ruff: noqa: E501  (each sample stays on its lines, as it would appear in a conversation)
"""Corpora for the redaction tests: secrets in realistic shapes (made up, never live) with the
distinctive part that must not survive, and look-alikes that must stay readable."""

from __future__ import annotations

import json
from typing import NamedTuple


class Secret(NamedTuple):
    name: str
    text: str
    #: Substrings of the secret that must appear nowhere in a redacted export.
    parts: tuple[str, ...]


AWS_KEY_ID = "AKIA2E0A8F3B244C9986"
AWS_SECRET = "WbOxDGxmYBcw8mmX+bKRGJyUaSL7fievWoojHZbM"
AWS_SECRET_SLASHES = "gGQdpSwRw/08i/a6yiCqRbtbw6uJ25YTFFjy7h5U"
STS_TOKEN = (
    "IQoJb3JpZ2luX2VjEyLMPrY942SvjSDsCD5HBxNnfiJhnosFHTKrdQXrzfFZY9SHE3cR+h0qdAhttFNDnN0UBg73uQzFHSf"
    "koGtbt1PMN4gU34R+dwBcdXg1SxRrtGwN0Ey7yo3CABwgp/pZyCh06/3sAtI8Mgc+cHPC0ThrJyVXDm9FU76et0qCTHsMw8y"
    "2OagkicVJtvTTRjojqKxoMGC/4co8Kbdp1f/G08ERMXLLD08h3eyNhay4YC2lNLv3MTI4mZaqkNGviItRqjdkhfkVJT9Sua6QN"
    "9g7dU2c12VIcGDT/vSViA14BpVmh=="
)
STS_TOKEN_OLD = (
    "FwoGZXIvYXdzEI2Qhw0fjsrF2GYyivjEcGO6LaV09K1Q0WGoeNXLq1dp6l6gm5q3zUZ7S9bBxhGJCQLsb9xN/ciBmUJzOIWX"
    "09EL1/uyafDL5OWM+nnwo/sOVFArSi5Vb1Q6QfxJpgZEaTcAllhVwnPPKbJIazOXE4k9qwtXibl7Q49ui5b1WlNsB1MLhUMbk"
    "WQ4nBeieH9dw0UDuOvIv"
)
RSA_BODY = (
    "MIIEpAIBAAKCAQEA3Tz2mr7SZiAMfQyuvBjM9Oi5m0mCMbZ6RzFvZ8tV0o5wG1Xq\n"
    "Rk8sPz4YwB7nC1dE5fG6hJ0kLq9Xw3xQyNTUxOQAAACD3x2Gm8kqT2bVnLp0Lm4e\n"
    "Yc1Hd4Jf6Gs0Ka9Ue3MzWbOxDGxmYBcw8mmXbKRGJyUaSL7fievWoojHZbMaK0coP"
)
PKCS8_BODY = (
    "MIIEvgIBADANBgkqhkiG9w0BAQEFAASCBKgwggSkAgEAAoIBAQC7VJTUt9Us8cKj\n"
    "MzEfYyjiWA4R4/M2bS1GB4t7NXp98C3SC6dVMvDuictGeurT8jNbvJZHtCSuYEvu"
)
GCP_KEY_ID = "a80cd3e183d1641da1b9e79da8cb3c5ccdaf6ea4"
GCP_SERVICE_ACCOUNT = json.dumps(
    {
        "type": "service_account",
        "project_id": "hermes-prod-381204",
        "private_key_id": GCP_KEY_ID,
        "private_key": f"-----BEGIN PRIVATE KEY-----\n{PKCS8_BODY}\n-----END PRIVATE KEY-----\n",
        "client_email": "exporter@hermes-prod-381204.iam.gserviceaccount.com",
        "client_id": "104958203984759203847",
        "token_uri": "https://oauth2.googleapis.com/token",
    },
    indent=2,
)
JWT = (
    "eyJhbGciOiJIUzI1NiIsInR5cCI6IkpXVCJ9.eyJzdWIiOiJ1c2VyLTQyIiwicm9sZSI6ImFkbWluIiwiZXhwIjoxNzY0OTk5"
    "OTk5fQ.Qm9ZcH3kL8sVnT2rXw5yJ7aB1dF4gH6iK9mN0pR3sU"
)

SECRETS: list[Secret] = [
    # -- the seventeen shapes the issue reported as leaking --------------------------------
    Secret(
        "json-password", '{"username": "deploy", "password": "Vq8#mZ2!rT5wLp"}', ("Vq8#mZ2!rT5wLp",)
    ),
    Secret(
        "json-api-key",
        '{"service": "geocoder", "api_key": "a83kf92jd0slq7vneyw1"}',
        ("a83kf92jd0slq7vneyw1",),
    ),
    Secret(
        "json-client-secret",
        '{"client_id": "hermes-web", "client_secret": "kT9vYw2xQpLm4NbR7sZc"}',
        ("kT9vYw2xQpLm4NbR7sZc",),
    ),
    Secret(
        "json-basic-auth-header",
        '{"url": "https://api.internal/v1", "headers": {"Authorization": "Basic YWRtaW46UzNjcjN0UGFzcw=="}}',
        ("YWRtaW46UzNjcjN0UGFzcw",),
    ),
    Secret(
        "json-x-api-key-header",
        '{"method": "GET", "headers": {"x-api-key": "0886d3f6ee19bf448f50e1f3dccbab33", "accept": "application/json"}}',
        ("0886d3f6ee19bf448f50e1f3dccbab33",),
    ),
    Secret(
        "env-pgpassword",
        "PGPASSWORD=pgS3cret_2024 psql -h db.internal -U app -d orders",
        ("pgS3cret_2024",),
    ),
    Secret(
        "env-db-pass",
        "DB_HOST=db.internal\nDB_USER=app\nDB_PASS=Wint3rIsC0ming\n",
        ("Wint3rIsC0ming",),
    ),
    Secret(
        "env-mysql-pwd", "MYSQL_PWD='my5ql-Pw9x' mysql -u root -h 10.0.3.7 shop", ("my5ql-Pw9x",)
    ),
    Secret(
        "flag-password-value",
        "mongodump --host mongo.internal --username admin --password Mg0Pa55word99 --db app",
        ("Mg0Pa55word99",),
    ),
    Secret(
        "url-password-encoded-at-slash",
        "DATABASE_URL=postgresql://app:p%40ssw0rd%2Fx9Q@db.internal:5432/app",
        ("p%40ssw0rd%2Fx9Q", "ssw0rd"),
    ),
    Secret(
        "url-password-raw-at-slash",
        "redis://default:R3d1s@pw/9kQ@cache.internal:6379/0",
        ("R3d1s@pw/9kQ", "pw/9kQ"),
    ),
    Secret(
        "aws-secret-json",
        f'{{"Credentials": {{"AccessKeyId": "{AWS_KEY_ID}", "SecretAccessKey": "{AWS_SECRET}", "Expiration": "2026-12-05T13:00:00Z"}}}}',
        (AWS_SECRET, AWS_KEY_ID),
    ),
    Secret(
        "aws-secret-prose",
        f"I set the AWS secret key to {AWS_SECRET_SLASHES} in the CI variables.",
        (AWS_SECRET_SLASHES,),
    ),
    Secret(
        "aws-configure",
        f"$ aws configure\nAWS Access Key ID [None]: {AWS_KEY_ID}\nAWS Secret Access Key [None]: {AWS_SECRET_SLASHES}\nDefault region name [None]: eu-west-1\nDefault output format [None]: json",
        (AWS_KEY_ID, AWS_SECRET_SLASHES),
    ),
    Secret(
        "aws-sts-session",
        f"export AWS_ACCESS_KEY_ID=ASIAY34FZKBOKMUTVV7A\nexport AWS_SECRET_ACCESS_KEY={AWS_SECRET}\nexport AWS_SESSION_TOKEN={STS_TOKEN}",
        ("ASIAY34FZKBOKMUTVV7A", AWS_SECRET, STS_TOKEN[20:80], STS_TOKEN[-60:-2]),
    ),
    Secret(
        "slack-xapp",
        "SLACK_APP_TOKEN=xapp-1-A05R3G7K9LM-5830193847261-8f3c1e9a7b2d4f6081c3e5a7b9d1f3e5a7c9b1d3f5e7a9c1b3d5f7e9a1c3e5b7",
        ("A05R3G7K9LM-5830193847261-8f3c1e9a7b2d",),
    ),
    Secret(
        "gcp-private-key-id", GCP_SERVICE_ACCOUNT, (GCP_KEY_ID, PKCS8_BODY[:60], PKCS8_BODY[-40:])
    ),
    # -- AWS, beyond the above ---------------------------------------------------------------
    Secret(
        "aws-credentials-ini",
        f"[default]\naws_access_key_id = {AWS_KEY_ID}\naws_secret_access_key = {AWS_SECRET_SLASHES}\nregion = us-east-1",
        (AWS_KEY_ID, AWS_SECRET_SLASHES),
    ),
    Secret(
        "aws-sts-json",
        f'{{"Credentials": {{"AccessKeyId": "ASIAY34FZKBOKMUTVV7A", "SecretAccessKey": "{AWS_SECRET_SLASHES}", "SessionToken": "{STS_TOKEN_OLD}"}}}}',
        (AWS_SECRET_SLASHES, STS_TOKEN_OLD[15:90]),
    ),
    Secret(
        "aws-session-token-prose",
        f"the session token {STS_TOKEN} expires in an hour",
        (STS_TOKEN[20:80],),
    ),
    Secret(
        "aws-configure-set",
        f"aws configure set aws_secret_access_key {AWS_SECRET} --profile ci",
        (AWS_SECRET,),
    ),
    # -- model and code hosts ----------------------------------------------------------------
    Secret(
        "openai-project-key",
        "export OPENAI_API_KEY=sk-proj-Xq3vT9aLm2Rk8sPz4YwB7nC1dE5fG6hJ0kL",
        ("Xq3vT9aLm2Rk8sPz4YwB7nC1dE5fG6hJ0kL",),
    ),
    Secret(
        "openai-legacy-key",
        "client = OpenAI(api_key='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')",
        ("WbOxDGxmYBcw8mmXbKRGT3BlbkFJyUaSL7fievWoojHZbM2x",),
    ),
    Secret(
        "anthropic-key",
        "ANTHROPIC_API_KEY=sk-ant-api03-aguZOnt28En3ZpOe11bgavd7BVZBoiIQSdXg3cFsPDGcN8msEgrR7XeZ-47aTngHp4SRoo",
        ("aguZOnt28En3ZpOe11bgavd7BVZBoiIQSdXg3cFsPDGcN8",),
    ),
    Secret(
        "huggingface-token",
        "huggingface-cli login --token hf_oWNz8RsoOVVajX8bAnPR34i90qrTf16lYS",
        ("oWNz8RsoOVVajX8bAnPR34i90qrTf16lYS",),
    ),
    Secret(
        "github-classic",
        "git clone https://ghp_p5RoKdZCuMtQo2rmxItCNkxjSIxYOs6J4ACS@github.com/acme/infra.git",
        ("p5RoKdZCuMtQo2rmxItCNkxjSIxYOs6J4ACS",),
    ),
    Secret(
        "github-fine-grained",
        "GH_TOKEN=github_pat_11ABCDEFG0syhH5BFBQZSk6en_66e9U8i0G9cFjCrfKOozYaPkisxT26Uww1KqIgWM2dVZ7pDZOuFCW",
        ("syhH5BFBQZSk6en_66e9U8i0G9cFjCrfKOozY",),
    ),
    Secret(
        "github-oauth",
        "token: gho_BD5yQ0XsStwx3AlHmAO5aguZOnt28En3ZpOe",
        ("BD5yQ0XsStwx3AlHmAO5aguZOnt28En3ZpOe",),
    ),
    Secret(
        "gitlab-pat",
        "git push https://oauth2:glpat-x39tlpmH5715FsXQlaav@gitlab.com/acme/app.git",
        ("x39tlpmH5715FsXQlaav",),
    ),
    Secret(
        "gitlab-runner",
        "gitlab-runner register --registration-token GR1348941WGOzsAqPEpP7j2WJbpVDSj",
        ("WGOzsAqPEpP7j2WJbpVDSj",),
    ),
    Secret(
        "npm-token",
        "npm_ixNAIVdqWZEFJ55vEl6ngwOWUMznkUlWelQ0 was printed by `npm token create`",
        ("ixNAIVdqWZEFJ55vEl6ngwOWUMznkUlWelQ0",),
    ),
    Secret(
        "npmrc-auth-token",
        "//registry.npmjs.org/:_authToken=3b9f0c8e-7a1d-4e2f-9c6b-5d8a7e1f0b2c",
        ("3b9f0c8e-7a1d-4e2f-9c6b-5d8a7e1f0b2c",),
    ),
    Secret(
        "npmrc-npm-token",
        "@acme:registry=https://npm.acme.io/\n//npm.acme.io/:_authToken=npm_syhH5BFBQZSk6en66e9U8i0G9cFjCrfKOozZ\n",
        ("syhH5BFBQZSk6en66e9U8i0G9cFjCrfKOozZ",),
    ),
    Secret(
        "pypi-token",
        "password = pypi-AgEIcHlwaS5vcmcCJGE4Zjk3YjE2LTk5YjMtNGE1ZC1hMzk3LWM1ZjU2YjZmNzM1NQACKlszLCJhNjM0N2ZkZC1hZmE4",
        ("CJGE4Zjk3YjE2LTk5YjMtNGE1ZC1hMzk3LWM1ZjU2YjZmNzM1NQACKlszLCJhNjM0N2ZkZC1hZmE4",),
    ),
    # -- chat, mail, payments ------------------------------------------------------------------
    Secret(
        "slack-bot",
        "SLACK_BOT_TOKEN=xoxb-2048193847261-5830193847261-BVZBoiIQSdXg3cFsPDGcN8ms",
        ("BVZBoiIQSdXg3cFsPDGcN8ms",),
    ),
    Secret(
        "slack-user",
        "curl -d token=xoxp-2048193847261-2048193847262-5830193847263-0886d3f6ee19bf448f50e1f3dccbab33 https://slack.com/api/chat.postMessage",
        ("5830193847263-0886d3f6ee19bf448f50e1f3dccbab33",),
    ),
    Secret(
        "slack-refresh",
        "refresh with xoxe-1-My0xLTIwNDgxOTM4NDcyNjEtNTgzMDE5Mzg0NzI2MS1hYmNkZWY",
        ("My0xLTIwNDgxOTM4NDcyNjEtNTgzMDE5Mzg0NzI2MS1hYmNkZWY",),
    ),
    Secret(
        "slack-webhook",
        "post to https://hooks.slack.com/services/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",
        ("qX9kV2mR7tL4wN8pZ3yB6cJd",),
    ),
    Secret(
        "discord-bot",
        "DISCORD_TOKEN is MTA5ODc2NTQzMjEwOTg3NjU0Mw.GhT8kL.ixNAIVdqWZEFJ55vEl6ngwOWUMznkUlWelQ",
        ("MTA5ODc2NTQzMjEwOTg3NjU0Mw.GhT8kL",),
    ),
    Secret(
        "discord-webhook",
        "https://discord.com/api/webhooks/1098765432109876543/-V9chN-UQMv0wQnWysK9ePu6QupmeKBbjosAIs5krdMhxML_emRQ3N-ixO2T",
        ("-V9chN-UQMv0wQnWysK9ePu6QupmeKBbjosAIs5krdMh",),
    ),
    Secret(
        "telegram-bot",
        "TELEGRAM_BOT_TOKEN=7123456789:AAEixNAIVdqWZEFJ55vEl6ngwOWUMznkUlq",
        ("AAEixNAIVdqWZEFJ55vEl6ngwOWUMznkUlq",),
    ),
    Secret(
        "telegram-bot-url",
        "GET https://api.telegram.org/bot6234567890:AAHp5RoKdZCuMtQo2rmxItCNkxjSIxYOs6J/getMe",
        ("AAHp5RoKdZCuMtQo2rmxItCNkxjSIxYOs6J",),
    ),
    Secret(
        "sendgrid",
        "SENDGRID_API_KEY=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",
        ("47aTngHp4SRooDsJvzygnmRrjQBZQCSykdQyv9v2fx0",),
    ),
    Secret(
        "mailchimp",
        "mailchimp key 54ecd0cf7c40a46f3256e279a6202476-us14 in settings.py",
        ("54ecd0cf7c40a46f3256e279a6202476",),
    ),
    Secret(
        "twilio",
        "TWILIO_ACCOUNT_SID=AC0886d3f6ee19bf448f50e1f3dccbab33\nTWILIO_API_KEY=SK54ecd0cf7c40a46f3256e279a6202476\nTWILIO_AUTH_TOKEN=b94374c8c4b382ef6f2ad9454d5cbdd5",
        (
            "0886d3f6ee19bf448f50e1f3dccbab33",
            "54ecd0cf7c40a46f3256e279a6202476",
            "b94374c8c4b382ef6f2ad9454d5cbdd5",
        ),
    ),
    Secret(
        "stripe-live",
        "stripe.api_key = 'sk_live_51HxQaBVZBoiIQSdXg3cFsPDGcN8ms'",
        ("51HxQaBVZBoiIQSdXg3cFsPDGcN8ms",),
    ),
    Secret(
        "stripe-restricted",
        "rk_live_51HxQaWGOzsAqPEpP7j2WJbpVDSj0000 is the read-only key",
        ("51HxQaWGOzsAqPEpP7j2WJbpVDSj0000",),
    ),
    Secret(
        "stripe-webhook",
        "STRIPE_WEBHOOK_SECRET=whsec_x39tlpmH5715FsXQlaavnnJPeAgJJwJu",
        ("x39tlpmH5715FsXQlaavnnJPeAgJJwJu",),
    ),
    Secret(
        "square",
        "square: sq0csp-47aTngHp4SRooDsJvzygnmRrjQBZQCSykdQyv9v2fx0 and EAAAx39tlpmH5715FsXQlaavnnJPeAgJJwJuPdWawPFzOuD9dXcNaPkisxT26Uww1KqIgW",
        (
            "47aTngHp4SRooDsJvzygnmRrjQBZQCSykdQyv9v2fx0",
            "x39tlpmH5715FsXQlaavnnJPeAgJJwJuPdWawPFzOuD9dXcN",
        ),
    ),
    Secret(
        "shopify",
        "X-Shopify-Access-Token: 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",
        ("0886d3f6ee19bf448f50e1f3dccbab33",),
    ),
    # -- clouds ----------------------------------------------------------------------------------
    Secret(
        "google-api-key",
        "https://maps.googleapis.com/maps/api/geocode/json?key=AIzaSyD-9tSrke72PouQMnMX-a7eZSW0jkFMBWY",
        ("AIzaSyD-9tSrke72PouQMnMX-a7eZSW0jkFMBWY",),
    ),
    Secret(
        "gcp-oauth-client-secret",
        '{"web": {"client_id": "1049.apps.googleusercontent.com", "client_secret": "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"}}',
        ("aguZOnt28En3ZpOe11bgavd7BVZB",),
    ),
    Secret(
        "azure-connection-string",
        "DefaultEndpointsProtocol=https;AccountName=hermesexports;AccountKey=VUDkheorSj9pGHlLJQXuAe6pWZPjgnQ3zc0OfVNI8gQSMTRuAXxqQmKOkcfYKBIegW4fm3o1aeRKHQXnzbl17Q==;EndpointSuffix=core.windows.net",
        ("VUDkheorSj9pGHlLJQXuAe6pWZPjgnQ3zc0OfVNI8gQSMTRuAXxqQmKOkcfYKBIegW4fm3o1aeRKHQXnzbl17Q",),
    ),
    Secret(
        "azure-sas",
        "https://hermesexports.blob.core.windows.net/dumps/a.jsonl?sv=2022-11-02&ss=b&srt=o&sp=r&se=2026-12-31T00:00:00Z&sig=x39tlpmH5715FsXQlaav%2BnnJPeAgJJwJuPdWawPFzOuD9%3D",
        ("x39tlpmH5715FsXQlaav%2BnnJPeAgJJwJuPdWawPFzOuD9",),
    ),
    Secret(
        "azure-service-bus",
        "Endpoint=sb://hermes.servicebus.windows.net/;SharedAccessKeyName=RootManageSharedAccessKey;SharedAccessKey=Ys8xZoSOD+rChyMebZSnQGUVfk2eHl6LsWan1DOm4k0=",
        ("Ys8xZoSOD+rChyMebZSnQGUVfk2eHl6LsWan1DOm",),
    ),
    Secret(
        "ibm-cloud-iam",
        "ibm_cloud_iam_api_key: aPkisxT26Uww1KqIgWM2dVZ7pDZOuFCW4iLW2MZhrt20",
        ("aPkisxT26Uww1KqIgWM2dVZ7pDZOuFCW4iLW2MZhrt20",),
    ),
    Secret(
        "ibm-cos-hmac",
        'cos_hmac_keys = {"access_key_id": "54ecd0cf7c40a46f3256e279a6202476", "secret_access_key": "b94374c8c4b382ef6f2ad9454d5cbdd5e54c3a9fbee363d3"}',
        ("b94374c8c4b382ef6f2ad9454d5cbdd5e54c3a9fbee363d3",),
    ),
    Secret(
        "softlayer",
        "softlayer_api_key = wniej35cyl22q2yapnc63rc9ra8gf96tix8f2ldfhkl0vnof0ynb44u4d6zil7en",
        ("wniej35cyl22q2yapnc63rc9ra8gf96tix8f2ldfhkl0vnof0ynb44u4d6zil7en",),
    ),
    Secret(
        "cloudant",
        "https://hermes-bx:8c31261207c6c5dff371d429709360fb6f84564df5baacb38fc79880004862ff@hermes-bx.cloudant.com",
        ("8c31261207c6c5dff371d429709360fb6f84564df5baacb38fc79880004862ff",),
    ),
    Secret(
        "heroku",
        "HEROKU_API_KEY=HRKU-AAx39tlpmH5715FsXQlaavnnJPeAgJJwJuPdWawPFzOuD9dXcN",
        ("x39tlpmH5715FsXQlaavnnJPeAgJJwJuPdWawPFzOuD9dXcN",),
    ),
    Secret(
        "artifactory",
        "ARTIFACTORY_API_KEY AKCp8x39tlpmH5715FsXQlaavnnJPeAgJJwJuPdWawPFzOuD9dXcN",
        ("x39tlpmH5715FsXQlaavnnJPeAgJJwJuPdWawPFzOuD9dXcN",),
    ),
    Secret(
        "vault-token",
        "export VAULT_TOKEN=hvs.CAESIJlWbOxDGxmYBcw8mmXbKRGJyUaSL7fievWoojHZbM",
        ("CAESIJlWbOxDGxmYBcw8mmXbKRGJyUaSL7fievWoojHZbM",),
    ),
    # -- database URLs and client flags --------------------------------------------------------
    Secret(
        "postgres-url",
        "postgres://hermes:S3cr3t-Pa55@db.internal:5432/hermes?sslmode=require",
        ("S3cr3t-Pa55",),
    ),
    Secret(
        "mysql-url",
        'engine = create_engine("mysql+pymysql://shop:Ch4ng3d!Pw@mysql.internal/shop")',
        ("Ch4ng3d!Pw",),
    ),
    Secret(
        "mongo-srv-url",
        "mongodb+srv://admin:hunter2hunter2@cluster0.abcde.mongodb.net/test?retryWrites=true",
        ("hunter2hunter2",),
    ),
    Secret(
        "redis-url-empty-user",
        "REDIS_URL=redis://:p4ssw0rdR3dis@localhost:6379/0",
        ("p4ssw0rdR3dis",),
    ),
    Secret(
        "jdbc-query-password",
        "jdbc:postgresql://db.internal:5432/app?user=app&password=Jdbc9Pass77&ssl=true",
        ("Jdbc9Pass77",),
    ),
    Secret(
        "ado-connection-string",
        "Server=tcp:sql.internal,1433;Database=app;User ID=app;Password=Ad0Conn!Str9;Encrypt=True;",
        ("Ad0Conn!Str9",),
    ),
    Secret(
        "mysql-p-attached",
        "mysql -u root -pRootPw4Mysql9 -h 127.0.0.1 shop < dump.sql",
        ("RootPw4Mysql9",),
    ),
    Secret("sshpass", "sshpass -p 'Ssh!Pass2024x' ssh deploy@10.0.3.7 uptime", ("Ssh!Pass2024x",)),
    Secret("redis-cli-a", "redis-cli -h cache.internal -a RedisAuth77x PING", ("RedisAuth77x",)),
    Secret(
        "curl-user",
        "curl -u admin:CurlPa55word9 https://jenkins.internal/api/json",
        ("CurlPa55word9",),
    ),
    Secret(
        "netrc",
        "machine api.heroku.com login ops@acme.io password 3b9f0c8e7a1d4e2f9c6b",
        ("3b9f0c8e7a1d4e2f9c6b",),
    ),
    Secret(
        "flag-token-equals", "./deploy --api-token=Dpl0yT0kenXq77 --env prod", ("Dpl0yT0kenXq77",)
    ),
    # -- headers ---------------------------------------------------------------------------------
    Secret(
        "bearer-jwt",
        f"curl -H 'Authorization: Bearer {JWT}' https://api.acme.io/v1/me",
        (JWT[40:100], JWT[-30:]),
    ),
    Secret(
        "bearer-opaque",
        'headers = {"Authorization": "Bearer 9f8e7d6c5b4a39281706f5e4d3c2b1a0"}',
        ("9f8e7d6c5b4a39281706f5e4d3c2b1a0",),
    ),
    Secret(
        "basic-header-text",
        "Authorization: Basic ZGVwbG95OlRyMHViNGRvciYzeA==",
        ("ZGVwbG95OlRyMHViNGRvciYzeA",),
    ),
    Secret(
        "token-header",
        "Authorization: token ghs_BD5yQ0XsStwx3AlHmAO5aguZOnt28En3ZpOe",
        ("BD5yQ0XsStwx3AlHmAO5aguZOnt28En3ZpOe",),
    ),
    Secret(
        "x-api-key-text",
        "x-api-key: 54ecd0cf7c40a46f3256e279a6202476\naccept: */*",
        ("54ecd0cf7c40a46f3256e279a6202476",),
    ),
    Secret(
        "cookie-header",
        "Cookie: sessionid=q8w7e6r5t4y3u2i1o0p9a8s7d6f5g4h3; csrftoken=Zx9kQm3Tn7Lp2Rv8Wb5Yc1Hd4Jf6Gs0K",
        ("q8w7e6r5t4y3u2i1o0p9a8s7d6f5g4h3", "Zx9kQm3Tn7Lp2Rv8Wb5Yc1Hd4Jf6Gs0K"),
    ),
    Secret(
        "set-cookie",
        "Set-Cookie: __Host-session=Sx8dC7vF6bG5nH4mJ3kL2qW1eR0tY9uI; Path=/; Secure; HttpOnly",
        ("Sx8dC7vF6bG5nH4mJ3kL2qW1eR0tY9uI",),
    ),
    Secret("jwt-prose", f"the id token was {JWT}", (JWT[40:100],)),
    # -- config files and code --------------------------------------------------------------
    Secret(
        "yaml-password",
        "database:\n  host: db.internal\n  user: app\n  password: correct-horse-battery-9\n",
        ("correct-horse-battery-9",),
    ),
    Secret(
        "yaml-quoted-secret",
        "auth:\n  jwt_secret: 'long and random but made of words'\n",
        ("long and random but made of words",),
    ),
    Secret(
        "k8s-secret-data",
        "apiVersion: v1\nkind: Secret\ndata:\n  password: SzhzUGFzc3dvcmQxMjM=\n  api-key: YWJjZGVmMTIzNDU2Nzg5MA==\n",
        ("SzhzUGFzc3dvcmQxMjM", "YWJjZGVmMTIzNDU2Nzg5MA"),
    ),
    Secret(
        "django-secret-key",
        "SECRET_KEY = 'django-insecure-9x$k2!m@qv7#b^w3&z+t8r(e)u1p'",
        ("9x$k2!m@qv7#b^w3&z+t8r(e)u1p",),
    ),
    Secret("python-kwarg", 'db.connect(user="app", password="Tr0ub4dor&3")', ("Tr0ub4dor&3",)),
    Secret(
        "terraform",
        'resource "aws_db_instance" "main" {\n  username = "app"\n  password = "TfDbPassw0rd!2026"\n}',
        ("TfDbPassw0rd!2026",),
    ),
    Secret(
        "dotenv-quoted",
        'STRIPE_SECRET="rk_test_placeholder_but_real_51HxQa"\nSMTP_PASSWORD="mail pass with spaces 7"',
        ("placeholder_but_real_51HxQa", "mail pass with spaces 7"),
    ),
    Secret(
        "json-escaped-in-text",
        'log: {\\"user\\": \\"bob\\", \\"password\\": \\"Esc4ped!Pw\\"}',
        ("Esc4ped!Pw",),
    ),
    Secret(
        "json-lines-output",
        '{"event": "login", "token": "Lg1nT0kenValue99"}\n{"event": "refresh", "refresh_token": "Rfr3shT0kenValue88"}',
        ("Lg1nT0kenValue99", "Rfr3shT0kenValue88"),
    ),
    Secret(
        "oauth-response",
        '{"access_token": "ya29.a0AfH6SMBxq9Lm2Rk8sPz4YwB7", "token_type": "Bearer", "expires_in": 3599, "refresh_token": "1//0gRt7Kp2Lm9Qx4Vb8Nc3"}',
        ("a0AfH6SMBxq9Lm2Rk8sPz4YwB7", "0gRt7Kp2Lm9Qx4Vb8Nc3"),
    ),
    Secret(
        "url-query-token",
        "GET https://api.example.com/v1/export?format=csv&access_token=Qk7Tz2Lm9Rv4Xw8Pn3Bc&page=2",
        ("Qk7Tz2Lm9Rv4Xw8Pn3Bc",),
    ),
    Secret(
        "yaml-passphrase-unquoted",
        "vault:\n  passphrase: correct horse battery staple  # rotated monthly\n",
        ("correct horse battery staple",),
    ),
    Secret(
        "markdown-credentials",
        "Here are the staging credentials:\n\n- **Username:** deploy\n- **Password:** Stag1ng!Pass\n- **API key**: `k7Qm2Xv9Lp4Rt8Wz`",
        ("Stag1ng!Pass", "k7Qm2Xv9Lp4Rt8Wz"),
    ),
    Secret(
        "prose-api-key",
        "Your API key: Zp4Kx8Qm2Vt7Lr9Wn3Bd (keep it safe) and the access token = Hy6Tg5Rf4Ed3Ws2Qa1Zx",
        ("Zp4Kx8Qm2Vt7Lr9Wn3Bd", "Hy6Tg5Rf4Ed3Ws2Qa1Zx"),
    ),
    Secret(
        "ini-password-spaces",
        "[client]\nuser = app\npassword = two Words 4 here\nhost = db.internal\n",
        ("two Words 4 here",),
    ),
    Secret(
        "yaml-block-scalar",
        "tls:\n  private_key_passphrase: |\n    first line of the Bl0ck phrase\n    and its second line\n  cert_file: /etc/tls/cert.pem\n",
        ("first line of the Bl0ck phrase", "and its second line"),
    ),
    Secret(
        "json-nested-under-secret",
        '{"db": {"secret": {"value": "N3stedS3cretV4l", "version": 3}}}',
        ("N3stedS3cretV4l",),
    ),
    Secret(
        "python-dict-repr",
        "{'user': 'svc', 'passwd': 'Py7hon!Repr', 'host': 'db'}",
        ("Py7hon!Repr",),
    ),
    Secret(
        "json-credentials-list",
        '{"credentials": ["Cr3dOne!x9", "Cr3dTwo!y8"]}',
        ("Cr3dOne!x9", "Cr3dTwo!y8"),
    ),
    # -- private keys ---------------------------------------------------------------------------
    Secret(
        "rsa-private-key",
        f"-----BEGIN RSA PRIVATE KEY-----\n{RSA_BODY}\n-----END RSA PRIVATE KEY-----",
        (RSA_BODY[:60], RSA_BODY[-40:]),
    ),
    Secret(
        "openssh-private-key",
        "-----BEGIN OPENSSH PRIVATE KEY-----\nb3BlbnNzaC1rZXktdjEAAAAABG5vbmUAAAAEbm9uZQAAAAAAAAABAAAAMwAAAAtzc2gtZW\nQyNTUxOQAAACD3x2Gm8kqT2bVnLp0Lm4eYc1Hd4Jf6Gs0Ka9Ue3MzWbOxDGxmYBcw8mm\n-----END OPENSSH PRIVATE KEY-----",
        (
            "b3BlbnNzaC1rZXktdjEAAAAABG5vbmUAAAAEbm9uZQ",
            "QyNTUxOQAAACD3x2Gm8kqT2bVnLp0Lm4eYc1Hd4Jf6Gs0Ka9Ue3M",
        ),
    ),
    Secret(
        "ec-private-key-truncated",
        "here it is: -----BEGIN EC PRIVATE KEY-----\nMHcCAQEEIBVZBoiIQSdXg3cFsPDGcN8msEgrR7XeZoAoGCCqGSM49\nAwEHoUQDQgAE",
        ("MHcCAQEEIBVZBoiIQSdXg3cFsPDGcN8msEgrR7XeZ",),
    ),
    Secret(
        "pgp-private-key",
        "-----BEGIN PGP PRIVATE KEY BLOCK-----\n\nlQdGBGVx39tlpmH5715FsXQlaavnnJPeAgJJwJuPdWawPFzOuD9dXcN\n=x9Kq\n-----END PGP PRIVATE KEY BLOCK-----",
        ("lQdGBGVx39tlpmH5715FsXQlaavnnJPeAgJJwJuPdWawPF",),
    ),
    Secret(
        "putty-key",
        "PuTTY-User-Key-File-2: ssh-rsa\nEncryption: none\nComment: deploy\nPublic-Lines: 1\nAAAAB3NzaC1yc2EAAAADAQABAAAAgQC7\nPrivate-Lines: 2\nAAAAgHm2Qx9Rz7Vb3Nc6Wd1Ye5Ua0Ps8Hj2KWbOxDGxmYBcw8mmX\nAAAAQQD5x39tlpmH5715FsXQlaavnnJPeAgJJwJu\nPrivate-MAC: 8c31261207c6c5dff371d429709360fb6f845640",
        ("AAAAgHm2Qx9Rz7Vb3Nc6Wd1Ye5Ua0Ps8Hj2KWbOxDG", "AAAAQQD5x39tlpmH5715FsXQlaavnnJPeAgJJwJu"),
    ),
]

#: Look-alikes: every one must come out of a redacted export unchanged.
LOOK_ALIKES: list[str] = [
    "git checkout 3f786850e387550fdab836ed7e6dc881de23001b && git log -1 --format=%H",
    "commit a80cd3e183d1641da1b9e79da8cb3c5ccdaf6ea4\nAuthor: Alice <alice@example.com>\nDate:   Fri Dec 4 10:12:44 2026 +0000",
    "sha256sum hermes.db: 8c31261207c6c5dff371d429709360fb6f84564df5baacb38fc79880004862ff",
    '{"sha256": "e3b0c44298fc1c149afbf4c8996fb92427ae41e4649b934ca495991b7852b855", "size": 0}',
    "session 7f3c9a2e-1b4d-4c8e-9f2a-0d1e2f3a4b5c ended; parent 0b8e2f1a-6c3d-4e5f-8a9b-1c2d3e4f5a6b",
    '{"request_id": "req_0886d3f6ee19bf448f50e1f3dccbab33", "trace_id": "54ecd0cf7c40a46f3256e279a6202476"}',
    "object id 507f1f77bcf86cd799439011, docker image sha256:9c7a54a9a43cca047013b82af109fe963fde787f63f9e016fdc3384500c2823d",
    "md5 of the file: d41d8cd98f00b204e9800998ecf8427e",
    "![chart](data:image/png;base64,iVBORw0KGgoAAAANSUhEUgAAAAEAAAABCAYAAAAfFcSJAAAADUlEQVR42mNkYPhfDwAChwGA60e6kgAAAABJRU5ErkJggg==)",
    "The password must be at least 12 characters and contain a digit.",
    "I reset your password: check your inbox for the link.",
    "Enter the password: it is not echoed. The cache key: user_42_profile_settings",
    "Forgot password? Click the link; passwords expire after 90 days.",
    "The secret to good soup is salt; the secret sauce is patience.",
    "max_tokens=2048, token_count = 42, input_tokens: 1200, tokenizer: cl100k_base",
    "api_key=os.environ['OPENAI_API_KEY']",
    "password = getpass.getpass()\ntoken = request.headers.get('X-Token')\nsecret = config.secret",
    "def login(user: str, password: str) -> None: ...",
    "interface Props { token: string; secret: boolean }",
    'password_length: 16\npassword_policy: "strong"\nsecret_name: prod-db-creds',
    "export DATABASE_URL=${DATABASE_URL}\npassword: ${DB_PASSWORD}",
    "Use bearer authentication for the gateway. Bearer of bad news: the deploy failed.",
    "2026-12-05T12:45:03.123456Z INFO request finished in 12.5 ms (status=200)",
    "1764938703.512 1764938704.009 and 12:45:03 UTC",
    "/home/alice/projects/hermes_store/hermes_store/redact.py:120: in redact_text",
    "C:\\Users\\alice\\AppData\\Local\\hermes\\state.db",
    "src/components/NavigationBar/HeaderMenuItem.tsx",
    "https://user@example.com/path and ssh://git@github.com:22/org/repo.git",
    "https://medium.com:443/@hermes/notes and http://localhost:8080/api?x=1",
    "postgresql://hermes@localhost/hermes and sqlite:///tmp/state.db",
    "-----BEGIN PUBLIC KEY-----\nMFkwEwYHKoZIzj0CAQYIKoZIzj0DAQcDQgAE\n-----END PUBLIC KEY-----",
    "ssh-ed25519 AAAAC3NzaC1lZDI1NTE5AAAAIOMqqnkVzrm0SdG6UOoqKLsabgH5C9okWi0dh2l9GKJl alice@laptop",
    "pip install scikit-learn  # the sk-learn package; shard keys sk-1 and sk-2",
    "AKIA is a prefix; AKIAshort is not a key.",
    "Email me at alice@example.com or call +1 555 0100.",
    "数据库迁移完成了 🚀 token bucket refill rate=5/s",
    "eyJhbGciOiJIUzI1NiJ9 alone is just a JWT header",
    "version: 3.11.4, build: 20261205.1, port: 5432, key: user_id",
    "cookie: the chocolate chip kind",
    "the primary_key is id and the cache_key is user:42",
    'ERROR: password authentication failed for user "app"',
    'diff --git a/db.py b/db.py\n-    password = os.getenv("DB_PASSWORD")\n+    password = settings.DB_PASSWORD',
    "self.token = token\nif not token:\n    raise ValueError('token required')",
    'if password == "": return None',
    "docker login -u bob --password-stdin < pw.txt; gh auth login --with-token < tok.txt",
    "Use --api-key to pass the key and --token-file ~/.tok for the rest.",
    "auth: oauth2\nauth_type: basic\nsession_token: None",
    "Authorization header missing; pass: true; passed: 12 tests",
    '{"token_type": "Bearer", "expires_in": 3599, "scope": "email profile"}',
]
