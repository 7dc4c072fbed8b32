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
--
-- The token is a session setting, so a rollback of the transaction that pinned
-- (or a later RESET ALL / DISCARD ALL) takes it off the session while the client
-- still holds its pin. A missing token on the pinned backend is therefore no
-- sign of another client (one that pins sets a token of its own): the check
-- passes and puts the token back. Whatever session locks such a reset (or the
-- end of a backend whose pid came round again) took away, the slot and ticker
-- calls notice through their own lock checks.

-- pgque.pin_session(token): records token as this server session's owner (a
-- session-level setting) and returns the backend pid; the pair identifies the
-- session for session_checked. Raises 22023 for a token that is null, empty
-- or longer than 64 characters.
create or replace function pgque.pin_session(p_token text)
returns integer
language plpgsql
set search_path = pg_catalog, pg_temp
set jit = off
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
-- on backend pid and that backend is pinned with token, or carries no token at
-- all (a rollback or RESET undid the pin on this very session: the token is
-- set again, for the session, so it comes back with this call's transaction);
-- raises PQ025 on another backend, or when the backend carries another token
-- (another client pinned it since). Callers wrap an argument of the call that
-- needs the session in it, so the check and the call are one statement: either
-- both happen on the pinned session, or neither takes effect.
create or replace function pgque.session_checked(p_value text, p_pid integer, p_token text)
returns text
language plpgsql volatile
set search_path = pg_catalog, pg_temp
set jit = off
as $$
declare
    v_token text := coalesce(current_setting('pgque.session_token', true), '');
begin
    if v_token = '' and pg_backend_pid() = p_pid
       and length(p_token) between 1 and 64 then
        perform set_config('pgque.session_token', p_token, false);
        v_token := p_token;
    end if;
    if pg_backend_pid() is distinct from p_pid or v_token is distinct from p_token then
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
