-- Running upgrade v4_title_unique_index -> v5_billing_columns

ALTER TABLE sessions ADD COLUMN cache_read_tokens INTEGER DEFAULT 0;

ALTER TABLE sessions ADD COLUMN cache_write_tokens INTEGER DEFAULT 0;

ALTER TABLE sessions ADD COLUMN reasoning_tokens INTEGER DEFAULT 0;

ALTER TABLE sessions ADD COLUMN billing_provider TEXT;

ALTER TABLE sessions ADD COLUMN billing_base_url TEXT;

ALTER TABLE sessions ADD COLUMN billing_mode TEXT;

ALTER TABLE sessions ADD COLUMN estimated_cost_usd REAL;

ALTER TABLE sessions ADD COLUMN actual_cost_usd REAL;

ALTER TABLE sessions ADD COLUMN cost_status TEXT;

ALTER TABLE sessions ADD COLUMN cost_source TEXT;

ALTER TABLE sessions ADD COLUMN pricing_version TEXT;

DELETE FROM schema_version;

INSERT INTO schema_version (version) VALUES (5);

UPDATE alembic_version SET version_num='v5_billing_columns' WHERE alembic_version.version_num = 'v4_title_unique_index';

