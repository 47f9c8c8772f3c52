"""Build benchmark databases through the store's public API (so building is a test too)."""

from __future__ import annotations

import contextlib
import time
from typing import Any

import sqlalchemy as sa
from sqlalchemy.engine import URL, make_url
from sqlalchemy.pool import NullPool

from bench.corpus import Corpus
from hermes_store import SessionDB


def build(store: SessionDB, corpus: Corpus) -> float:
    """Write every planned session (rows, messages, ends, titles, tokens); seconds taken."""
    start = time.perf_counter()
    for plan in corpus.iter_plans():
        store.create_session(
            plan.session_id, plan.source, model=plan.model, parent_session_id=plan.parent_id
        )
        store.append_messages(plan.session_id, plan.messages)
        store.update_token_counts(
            plan.session_id,
            input_tokens=plan.tokens[0],
            output_tokens=plan.tokens[1],
            estimated_cost_usd=0.01,
        )
        if plan.title:
            store.set_session_title(plan.session_id, plan.title)
        if plan.end_reason:
            store.end_session(plan.session_id, plan.end_reason)
    return time.perf_counter() - start


def fresh_pg_database(base: str, name: str) -> URL:
    """Drop and create database ``name`` on the server of ``base``; its URL."""
    url = make_url(base)
    if url.drivername in ("postgresql", "postgres"):
        url = url.set(drivername="postgresql+psycopg")
    admin = sa.create_engine(url, isolation_level="AUTOCOMMIT", poolclass=NullPool)
    with admin.connect() as conn:
        conn.exec_driver_sql(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')
        conn.exec_driver_sql(f'CREATE DATABASE "{name}"')
    admin.dispose()
    return url.set(database=name)


def drop_pg_database(base: str, name: str) -> None:
    url = make_url(base)
    if url.drivername in ("postgresql", "postgres"):
        url = url.set(drivername="postgresql+psycopg")
    admin = sa.create_engine(url, isolation_level="AUTOCOMMIT", poolclass=NullPool)
    with contextlib.suppress(sa.exc.SQLAlchemyError), admin.connect() as conn:
        conn.exec_driver_sql(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')
    admin.dispose()


def pg_server_version(url: URL | str) -> str:
    engine = sa.create_engine(url, poolclass=NullPool)
    try:
        with engine.connect() as conn:
            value: Any = conn.exec_driver_sql("SHOW server_version").scalar()
    finally:
        engine.dispose()
    return str(value)
