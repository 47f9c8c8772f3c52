BEGIN;

-- Running upgrade h7_cjk_index -> h8_pg_bigint_counters

SET LOCAL lock_timeout = '30s';

ALTER TABLE sessions ALTER COLUMN message_count TYPE BIGINT, ALTER COLUMN tool_call_count TYPE BIGINT, ALTER COLUMN input_tokens TYPE BIGINT, ALTER COLUMN output_tokens TYPE BIGINT, ALTER COLUMN cache_read_tokens TYPE BIGINT, ALTER COLUMN cache_write_tokens TYPE BIGINT, ALTER COLUMN reasoning_tokens TYPE BIGINT;

ALTER TABLE messages ALTER COLUMN token_count TYPE BIGINT;

UPDATE alembic_version SET version_num='h8_pg_bigint_counters' WHERE alembic_version.version_num = 'h7_cjk_index';

COMMIT;

