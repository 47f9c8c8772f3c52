BEGIN;

-- Running upgrade v5_billing_columns -> v6_reasoning_columns

ALTER TABLE messages ADD COLUMN reasoning TEXT;

ALTER TABLE messages ADD COLUMN reasoning_details TEXT;

ALTER TABLE messages ADD COLUMN codex_reasoning_items TEXT;

DELETE FROM schema_version;

INSERT INTO schema_version (version) VALUES (6);

UPDATE alembic_version SET version_num='v6_reasoning_columns' WHERE alembic_version.version_num = 'v5_billing_columns';

COMMIT;

