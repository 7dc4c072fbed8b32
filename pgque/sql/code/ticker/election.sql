-- pgque: the ticker election.
--
-- Any number of tickers (pgque.Ticker, every Worker's, pg_cron's
-- ticker_loop) may run against a database; the active one holds a session
-- advisory lock on the install's random election key (pgque.ticker_election)
-- and the others stand by. The key is not published, but pg_locks shows it
-- while it is held, and advisory locks need no privilege: a role that may not
-- tick could wait on it and get it when the active ticker goes. So only
-- sessions of roles that may run claim_ticker count, and a claim that finds
-- the key held or awaited by no such session, only by others, renews it.
-- (The standbys' tick_overdue keeps delivery going meanwhile in any case.)


-- pgque._ticker_key(): the current election key.
create or replace function pgque._ticker_key()
returns bigint
language sql stable
set search_path = pg_catalog, pg_temp
as $$ select te_key from pgque.ticker_election $$;

-- pgque._may_tick(role): whether sessions of role (an oid: a login role, as
-- pg_stat_activity shows it) count in the election: those whose role, or a
-- role they are members of, may run claim_ticker (admins, or roles granted it).
create or replace function pgque._may_tick(p_role oid)
returns boolean
language sql stable
set search_path = pg_catalog, pg_temp
as $$ select pgque._may_execute(p_role, to_regprocedure('pgque.claim_ticker()')) $$;

-- pgque.claim_ticker(): tries, without waiting, to become the active ticker
-- of the database; true when this session holds the election lock (also
-- when it already did). Renews the key first when only sessions that may not
-- tick hold or await it.
create or replace function pgque.claim_ticker()
returns boolean
language plpgsql
security definer
set search_path = pg_catalog, pg_temp
set jit = off
as $$
begin
    if not pgque._may_tick(pgque._session_role()) then
        raise exception using errcode = '42501',
            message = format('sessions of login role %s do not count in the ticker election',
                             pgque._session_role()::regrole),
            hint = 'The election judges sessions by their login role: grant the login role '
                   '(or a role it is a member of) pgque_admin.';
    end if;
    return pgque._holds_key(pgque._ticker_key())
        or pgque._take_key('ticker', null);
end
$$;

-- pgque.release_ticker(): gives up the election if this session holds it;
-- true when it did.
create or replace function pgque.release_ticker()
returns boolean
language sql
security definer
set search_path = pg_catalog, pg_temp
set jit = off
as $$ select pgque._unlock_key(pgque._ticker_key()) $$;

-- pgque.active_ticker(): the backend pid of the active ticker, or null. Only
-- sessions that may tick count.
create or replace function pgque.active_ticker()
returns integer
language sql volatile
security definer
set search_path = pg_catalog, pg_temp
set jit = off
as $$
    select k.pid from pgque._key_sessions(pgque._ticker_key()) k
     where k.granted and k.mode = 'ExclusiveLock' and pgque._may_tick(k.role)
     limit 1
$$;
