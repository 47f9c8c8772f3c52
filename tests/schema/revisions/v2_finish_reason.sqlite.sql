-- Running upgrade v1_base -> v2_finish_reason

ALTER TABLE messages ADD COLUMN finish_reason TEXT;

DELETE FROM schema_version;

INSERT INTO schema_version (version) VALUES (2);

UPDATE alembic_version SET version_num='v2_finish_reason' WHERE alembic_version.version_num = 'v1_base';

