-- Running upgrade h8_pg_bigint_counters -> h10_pg_long_text

UPDATE alembic_version SET version_num='h10_pg_long_text' WHERE alembic_version.version_num = 'h8_pg_bigint_counters';

