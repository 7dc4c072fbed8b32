-- pgque: pinned sessions.
--
-- Slot ownership and the ticker election are session advisory locks: they
-- mean something only while every call of a client reaches the same server
-- session. Behind a transaction-mode pooler (PgBouncer and the like) one
-- client's calls may run on different server sessions, and one server session
-- may serve several clients in turn, so a lock belongs to whoever happens to
-- be there. A client that relies on its session pins it once (pin_session,
-- with a random token) and passes a value of every such call through
-- session_checked, which raises PQ025 as soon as the call runs on another
-- backend, or on a backend that another client has pinned since.

-- pgque.pin_session(token): records token as this server session's owner (a
-- session-level setting) and returns the backend pid; the pair identifies the
-- session for session_checked. Raises 22023 for a token that is null, empty
-- or longer than 64 characters.
create or replace function pgque.pin_session(p_token text)
returns integer
language plpgsql
set search_path = pg_catalog, pg_temp
as $$
begin
    if p_token is null or length(p_token) not between 1 and 64 then
        raise exception using errcode = '22023',
            message = 'a session token must have 1 to 64 characters';
    end if;
    perform set_config('pgque.session_token', p_token, false);
    return pg_backend_pid();
end
$$;

-- pgque.session_checked(value, pid, token): returns value when this call runs
-- on backend pid and that backend is still pinned with token; raises PQ025
-- otherwise. Callers wrap an argument of the call that needs the session in
-- it, so the check and the call are one statement: either both happen on the
-- pinned session, or neither takes effect.
create or replace function pgque.session_checked(p_value text, p_pid integer, p_token text)
returns text
language plpgsql volatile
set search_path = pg_catalog, pg_temp
as $$
begin
    if pg_backend_pid() is distinct from p_pid
       or current_setting('pgque.session_token', true) is distinct from p_token then
        raise exception using errcode = 'PQ025',
            message = format('the server session behind this connection changed (backend %s, '
                             'pinned %s): is a transaction-mode pooler in between?',
                             pg_backend_pid(), p_pid),
            hint = 'Slot ownership and the ticker election are session locks: connect '
                   'directly, or through a pooler in session mode.';
    end if;
    return p_value;
end
$$;
