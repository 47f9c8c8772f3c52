BEGIN;

-- Running upgrade h9_write_keys -> h10_pg_long_text

CREATE TABLE IF NOT EXISTS message_text_chunks (
    message_id BIGINT NOT NULL,
    chunk_no INTEGER NOT NULL,
    tsv TSVECTOR NOT NULL,
    PRIMARY KEY (message_id, chunk_no)
);

CREATE INDEX IF NOT EXISTS ix_message_text_chunks_tsv ON message_text_chunks USING gin (tsv);

CREATE OR REPLACE FUNCTION hermes_text_cut(body bytea, at integer)
RETURNS integer LANGUAGE plpgsql IMMUTABLE STRICT AS $fn$
DECLARE
    total integer := octet_length(body);
    seek bytea;
    best integer := 0;
    found integer;
    separator bytea;
BEGIN
    IF at >= total THEN
        RETURN total;
    END IF;
    seek := substring(body FROM at + 1 FOR 1024);
    FOREACH separator IN ARRAY ARRAY['\x20', '\x0a', '\x09', '\x0d']::bytea[] LOOP
        found := position(separator IN seek);
        IF found > 0 AND (best = 0 OR found < best) THEN
            best := found;
        END IF;
    END LOOP;
    IF best > 0 THEN
        RETURN at + best - 1;
    END IF;
    WHILE at < total AND get_byte(body, at) BETWEEN 128 AND 191 LOOP
        at := at + 1;
    END LOOP;
    RETURN at;
END
$fn$;

CREATE OR REPLACE FUNCTION hermes_index_message_text(message bigint, content text)
RETURNS integer LANGUAGE plpgsql
SET client_min_messages = warning SET search_path FROM CURRENT AS $fn$
DECLARE
    body bytea := convert_to(content, 'UTF8');
    total integer := octet_length(body);
    chunk_start integer := 0;
    cut integer;
    stop integer;
    chunk integer := 0;
BEGIN
    WHILE chunk_start < total LOOP
        cut := hermes_text_cut(body, chunk_start + 16000);
        stop := hermes_text_cut(body, cut + 1000);
        INSERT INTO message_text_chunks (message_id, chunk_no, tsv) VALUES (
            message, chunk, to_tsvector('simple'::regconfig,
                convert_from(substring(body FROM chunk_start + 1 FOR stop - chunk_start), 'UTF8')));
        chunk := chunk + 1;
        chunk_start := cut;
    END LOOP;
    RETURN chunk;
END
$fn$;

CREATE OR REPLACE FUNCTION hermes_message_text_chunks_sync()
RETURNS trigger LANGUAGE plpgsql SET search_path FROM CURRENT AS $fn$
BEGIN
    IF TG_OP <> 'INSERT' THEN
        DELETE FROM message_text_chunks WHERE message_id = OLD.id;
    END IF;
    IF TG_OP <> 'DELETE' AND octet_length(NEW.content) > 200000 THEN
        PERFORM hermes_index_message_text(NEW.id, NEW.content);
    END IF;
    RETURN NULL;
END
$fn$;

SET LOCAL lock_timeout = '30s';

CREATE TRIGGER messages_text_chunks_insert AFTER INSERT ON messages FOR EACH ROW WHEN (octet_length(NEW.content) > 200000) EXECUTE FUNCTION hermes_message_text_chunks_sync();

CREATE TRIGGER messages_text_chunks_update AFTER UPDATE OF id, content ON messages FOR EACH ROW WHEN (octet_length(OLD.content) > 200000 OR octet_length(NEW.content) > 200000) EXECUTE FUNCTION hermes_message_text_chunks_sync();

CREATE TRIGGER messages_text_chunks_delete AFTER DELETE ON messages FOR EACH ROW WHEN (octet_length(OLD.content) > 200000) EXECUTE FUNCTION hermes_message_text_chunks_sync();

SELECT count(hermes_index_message_text(id, content)) FROM messages WHERE octet_length(content) > 200000;

UPDATE alembic_version SET version_num='h10_pg_long_text' WHERE alembic_version.version_num = 'h9_write_keys';

COMMIT;

