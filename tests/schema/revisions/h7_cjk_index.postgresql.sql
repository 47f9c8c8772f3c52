BEGIN;

-- Running upgrade v6_reasoning_columns -> h7_cjk_index

UPDATE alembic_version SET version_num='h7_cjk_index' WHERE alembic_version.version_num = 'v6_reasoning_columns';

COMMIT;

