-- Running upgrade h9_write_keys -> h10_pg_long_text

UPDATE alembic_version SET version_num='h10_pg_long_text' WHERE alembic_version.version_num = 'h9_write_keys';

