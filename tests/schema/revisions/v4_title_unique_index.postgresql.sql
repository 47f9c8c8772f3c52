BEGIN;

-- Running upgrade v3_session_title -> v4_title_unique_index

CREATE UNIQUE INDEX IF NOT EXISTS idx_sessions_title_unique ON sessions (title) WHERE title IS NOT NULL;

DELETE FROM schema_version;

INSERT INTO schema_version (version) VALUES (4);

UPDATE alembic_version SET version_num='v4_title_unique_index' WHERE alembic_version.version_num = 'v3_session_title';

COMMIT;

