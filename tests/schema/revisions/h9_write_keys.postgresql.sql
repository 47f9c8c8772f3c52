BEGIN;

-- Running upgrade h8_pg_bigint_counters -> h9_write_keys

CREATE TABLE write_keys (
    key TEXT NOT NULL, 
    session_id TEXT NOT NULL, 
    message_id BIGINT, 
    created_at DOUBLE PRECISION NOT NULL, 
    CONSTRAINT pk_write_keys PRIMARY KEY (key)
);

CREATE INDEX ix_write_keys_session_id ON write_keys (session_id);

CREATE INDEX ix_write_keys_created_at ON write_keys (created_at);

UPDATE alembic_version SET version_num='h9_write_keys' WHERE alembic_version.version_num = 'h8_pg_bigint_counters';

COMMIT;

