-- Running upgrade h7_cjk_index -> h8_pg_bigint_counters

UPDATE alembic_version SET version_num='h8_pg_bigint_counters' WHERE alembic_version.version_num = 'h7_cjk_index';

