BEGIN;

CREATE TABLE alembic_version (
    version_num VARCHAR(32) NOT NULL, 
    CONSTRAINT alembic_version_pkc PRIMARY KEY (version_num)
);

-- Running upgrade  -> v1_base

CREATE TABLE schema_version (
    version INTEGER NOT NULL
);

CREATE TABLE sessions (
    id TEXT, 
    source TEXT NOT NULL, 
    user_id TEXT, 
    model TEXT, 
    model_config TEXT, 
    system_prompt TEXT, 
    parent_session_id TEXT, 
    started_at DOUBLE PRECISION NOT NULL, 
    ended_at DOUBLE PRECISION, 
    end_reason TEXT, 
    message_count INTEGER DEFAULT 0, 
    tool_call_count INTEGER DEFAULT 0, 
    input_tokens INTEGER DEFAULT 0, 
    output_tokens INTEGER DEFAULT 0, 
    CONSTRAINT pk_sessions PRIMARY KEY (id), 
    CONSTRAINT fk_sessions_parent_session_id_sessions FOREIGN KEY(parent_session_id) REFERENCES sessions (id)
);

CREATE TABLE messages (
    id BIGSERIAL, 
    session_id TEXT NOT NULL, 
    role TEXT NOT NULL, 
    content TEXT, 
    tool_call_id TEXT, 
    tool_calls TEXT, 
    tool_name TEXT, 
    timestamp DOUBLE PRECISION NOT NULL, 
    token_count INTEGER, 
    CONSTRAINT pk_messages PRIMARY KEY (id), 
    CONSTRAINT fk_messages_session_id_sessions FOREIGN KEY(session_id) REFERENCES sessions (id)
);

CREATE INDEX idx_sessions_source ON sessions (source);

CREATE INDEX idx_sessions_parent ON sessions (parent_session_id);

CREATE INDEX idx_sessions_started ON sessions (started_at DESC);

CREATE INDEX idx_messages_session ON messages (session_id, timestamp);

ALTER TABLE messages ADD COLUMN IF NOT EXISTS content_tsv tsvector GENERATED ALWAYS AS (to_tsvector('simple'::regconfig, left(COALESCE(content, ''), 200000))) STORED;

CREATE INDEX IF NOT EXISTS ix_messages_content_fts ON messages USING gin (content_tsv);

CREATE EXTENSION IF NOT EXISTS pg_trgm;

CREATE INDEX IF NOT EXISTS ix_messages_content_trgm ON messages USING gin (content gin_trgm_ops);

DELETE FROM schema_version;

INSERT INTO schema_version (version) VALUES (1);

INSERT INTO alembic_version (version_num) VALUES ('v1_base') RETURNING alembic_version.version_num;

COMMIT;

