#!/bin/sh
# Start PostgreSQL as the upstream `postgres` image does: on an empty $PGDATA, initdb with POSTGRES_USER as
# superuser and POSTGRES_PASSWORD (required; password auth over TCP), create POSTGRES_DB, run
# /docker-entrypoint-initdb.d/*.sql; then run the server as the `postgres` user, listening on all addresses.
set -eu
bin=$(ls -d /usr/lib/postgresql/*/bin | sort -V | tail -n 1)
: "${POSTGRES_USER:=postgres}"
: "${POSTGRES_DB:=$POSTGRES_USER}"
if [ -z "${POSTGRES_PASSWORD:-}" ]; then
    echo "error: POSTGRES_PASSWORD is empty; set it (grpo infra up generates one into the stack's env file)" >&2
    exit 1
fi
as_postgres() { setpriv --reuid=postgres --regid=postgres --init-groups "$@"; }

mkdir -p "$PGDATA" /run/postgresql
chown postgres:postgres "$PGDATA" /run/postgresql
chmod 700 "$PGDATA"
if [ ! -s "$PGDATA/PG_VERSION" ]; then
    pwfile=$(mktemp)
    printf '%s\n' "$POSTGRES_PASSWORD" > "$pwfile"
    chown postgres "$pwfile"
    as_postgres "$bin/initdb" -D "$PGDATA" -U "$POSTGRES_USER" --pwfile="$pwfile" \
        --auth-local=trust --auth-host=scram-sha-256 --encoding=UTF8 --locale=C.UTF-8 >/dev/null
    rm -f "$pwfile"
    echo "host all all all scram-sha-256" >> "$PGDATA/pg_hba.conf"
    # First start on the socket only: create the database and run the init scripts.
    as_postgres "$bin/pg_ctl" -D "$PGDATA" -o "-c listen_addresses=''" -w start >/dev/null
    psql() { as_postgres "$bin/psql" -v ON_ERROR_STOP=1 -q -U "$POSTGRES_USER" "$@"; }
    if [ "$POSTGRES_DB" != postgres ]; then
        psql -d postgres -c "CREATE DATABASE \"$POSTGRES_DB\""
    fi
    for f in /docker-entrypoint-initdb.d/*.sql; do
        [ -e "$f" ] || continue
        echo "running $f"
        psql -d "$POSTGRES_DB" -f "$f"
    done
    as_postgres "$bin/pg_ctl" -D "$PGDATA" -m fast -w stop >/dev/null
    echo "database initialised in $PGDATA"
fi
exec setpriv --reuid=postgres --regid=postgres --init-groups "$bin/postgres" -D "$PGDATA" -c listen_addresses='*'
