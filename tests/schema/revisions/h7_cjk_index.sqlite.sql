-- Running upgrade v6_reasoning_columns -> h7_cjk_index

CREATE VIRTUAL TABLE IF NOT EXISTS messages_cjk USING fts5(
    content,
    content='',
    detail='none',
    tokenize='trigram'
);

CREATE TRIGGER IF NOT EXISTS messages_cjk_insert AFTER INSERT ON messages
WHEN length(CAST(new.content AS BLOB)) > length(new.content) AND new.content GLOB '*[฀-໿က-႟ᄀ-ᇿក-៿　-ヿ㄰-㆏㐀-䶿一-鿿가-힯豈-﫿･-ﾟ𠀀-𮯯]*' BEGIN
    INSERT INTO messages_cjk(rowid, content) VALUES (new.id, new.content);
END;

CREATE TRIGGER IF NOT EXISTS messages_cjk_delete AFTER DELETE ON messages
WHEN length(CAST(old.content AS BLOB)) > length(old.content) AND old.content GLOB '*[฀-໿က-႟ᄀ-ᇿក-៿　-ヿ㄰-㆏㐀-䶿一-鿿가-힯豈-﫿･-ﾟ𠀀-𮯯]*' BEGIN
    INSERT INTO messages_cjk(messages_cjk, rowid, content) VALUES ('delete', old.id, old.content);
END;

CREATE TRIGGER IF NOT EXISTS messages_cjk_update AFTER UPDATE ON messages
WHEN (length(CAST(old.content AS BLOB)) > length(old.content) AND old.content GLOB '*[฀-໿က-႟ᄀ-ᇿក-៿　-ヿ㄰-㆏㐀-䶿一-鿿가-힯豈-﫿･-ﾟ𠀀-𮯯]*') OR (length(CAST(new.content AS BLOB)) > length(new.content) AND new.content GLOB '*[฀-໿က-႟ᄀ-ᇿក-៿　-ヿ㄰-㆏㐀-䶿一-鿿가-힯豈-﫿･-ﾟ𠀀-𮯯]*') BEGIN
    INSERT INTO messages_cjk(messages_cjk, rowid, content)
        SELECT 'delete', old.id, old.content WHERE length(CAST(old.content AS BLOB)) > length(old.content) AND old.content GLOB '*[฀-໿က-႟ᄀ-ᇿក-៿　-ヿ㄰-㆏㐀-䶿一-鿿가-힯豈-﫿･-ﾟ𠀀-𮯯]*';
    INSERT INTO messages_cjk(rowid, content) SELECT new.id, new.content WHERE length(CAST(new.content AS BLOB)) > length(new.content) AND new.content GLOB '*[฀-໿က-႟ᄀ-ᇿក-៿　-ヿ㄰-㆏㐀-䶿一-鿿가-힯豈-﫿･-ﾟ𠀀-𮯯]*';
END;

INSERT INTO messages_cjk(rowid, content) SELECT id, content FROM messages WHERE content GLOB '*[฀-໿က-႟ᄀ-ᇿក-៿　-ヿ㄰-㆏㐀-䶿一-鿿가-힯豈-﫿･-ﾟ𠀀-𮯯]*';

UPDATE alembic_version SET version_num='h7_cjk_index' WHERE alembic_version.version_num = 'v6_reasoning_columns';

