BEGIN;

-- Running upgrade v2_finish_reason -> v3_session_title

ALTER TABLE sessions ADD COLUMN title TEXT;

DELETE FROM schema_version;

INSERT INTO schema_version (version) VALUES (3);

UPDATE alembic_version SET version_num='v3_session_title' WHERE alembic_version.version_num = 'v2_finish_reason';

COMMIT;

