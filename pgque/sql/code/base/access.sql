-- pgque: who may use which queue and which consumer.
--
-- The roles set the outer bound (pgque_writer sends, pgque_reader consumes,
-- pgque_admin does everything; see install/grants.sql). Inside it, two narrower
-- rules let several teams share one database:
--
--   * A consumer (a plain subscription or a consumer group) belongs to the
--     role that subscribed it. Receiving, acking, nacking, claiming its
--     slots, listing, replaying and purging its dead letters and
--     unsubscribing it are refused (PQ014) to every other role, except
--     admins and the roles its owner granted access to (grant_consumer).
--     Dead letters of a consumer that was unsubscribed are the admins' alone
--     (see consumers/dead_letters.sql).
--   * A queue may be restricted: once a role is granted 'send' on it
--     (grant_queue), only the granted roles may send to it; once one is
--     granted 'consume', only those may subscribe to it and consume from it
--     (PQ015 for the others). A queue without grants of a kind keeps the
--     role-wide rule, so single-team databases change nothing.
--
-- "Role R may" always means R or a role R is a member of (pg_has_role with
-- MEMBER). Admins are members of pgque_admin, superusers, and the role that
-- installed pgque. The caller is the role of the session (its SET ROLE, else
-- its login role): inside a SECURITY DEFINER function current_user is the
-- installer, so these functions read the session's role setting instead. A
-- caller that reaches pgque through a SECURITY DEFINER function of its own is
-- therefore judged as the session's role, not as that function's owner.
--
-- Errors (see pgque/errors.py): PQ014, PQ015, PQ016.

-- pgque._caller(): the name of the role the session acts as.
create or replace function pgque._caller()
returns name
language plpgsql stable
set search_path = pg_catalog, pg_temp
as $$
begin
    return (case when current_setting('role') = 'none' then session_user
                    else current_setting('role')::name end);
end
$$;

-- pgque._is_admin(role): whether role may do everything: a member of
-- pgque_admin or of the installer (current_user here, since only SECURITY
-- DEFINER functions call this), or a superuser.
create or replace function pgque._is_admin(p_role name)
returns boolean
language plpgsql stable
set search_path = pg_catalog, pg_temp
as $$
begin
    return (pg_has_role(p_role, current_user, 'member')
            or coalesce(pg_has_role(p_role, to_regrole('pgque_admin'), 'member'), false));
end
$$;

-- pgque._is_admin_id(role_oid): _is_admin for a role given by oid (another
-- session's login role, as pg_stat_activity shows it).
create or replace function pgque._is_admin_id(p_role oid)
returns boolean
language plpgsql stable
set search_path = pg_catalog, pg_temp
as $$
begin
    return (pg_has_role(p_role, current_user::regrole::oid, 'member')
            or coalesce(pg_has_role(p_role, to_regrole('pgque_admin'), 'member'), false));
end
$$;

-- pgque._in_roles(role, roles): whether role is a member of one of roles
-- (oids; ones dropped since simply match nobody).
create or replace function pgque._in_roles(p_role oid, p_roles oid[])
returns boolean
language plpgsql stable
set search_path = pg_catalog, pg_temp
as $$
begin
    return (select exists (select 1 from unnest(p_roles) g where pg_has_role(p_role, g, 'member')));
end
$$;

-- pgque._role_id(name): the oid of a role by name (the name exactly as
-- stored, not an identifier to parse).
create or replace function pgque._role_id(p_role name)
returns oid
language plpgsql stable
set search_path = pg_catalog, pg_temp
as $$
begin
    return (select oid from pg_roles where rolname = p_role);
end
$$;

-- pgque._may_execute(role, routine): whether role (an oid) or a role it is a
-- member of may execute routine. Membership, not inherited privilege: a login
-- created NOINHERIT that acts through SET ROLE team may do what team may.
create or replace function pgque._may_execute(p_role oid, p_routine regprocedure)
returns boolean
language plpgsql stable
set search_path = pg_catalog, pg_temp
as $$
begin
    return (p_role is not null and p_routine is not null
           and (has_function_privilege(p_role, p_routine, 'execute')
                or exists (select 1 from pg_proc p
                            cross join lateral aclexplode(coalesce(p.proacl,
                                                                   acldefault('f', p.proowner))) a
                            where p.oid = p_routine and a.privilege_type = 'EXECUTE'
                              and (a.grantee = 0 or pg_has_role(p_role, a.grantee, 'member')))));
end
$$;

-- pgque._may_consume(role, queue, owner, grantees): whether sessions of role
-- (an oid: another session's login role, as pg_stat_activity shows it) may
-- use a consumer of queue owned by owner with grantees: role, or a role it is
-- a member of, must be able to run receive_partitioned at all (a
-- pgque_reader, an admin or a role granted EXECUTE), pass the queue's
-- 'consume' grants, and own the consumer or have been granted it. An owner of
-- null (a consumer made before 0.2) lets every such role in. Used to tell
-- which sessions holding a slot's or group's lock count.
create or replace function pgque._may_consume(
    p_role oid, p_queue pgque.queue, p_owner oid, p_grantees oid[])
returns boolean
language plpgsql stable
set search_path = pg_catalog, pg_temp
as $$
begin
    return (p_role is not null
           and pgque._may_execute(
                   p_role, to_regprocedure('pgque.receive_partitioned(text,text,integer,integer,integer)'))
           and (pgque._is_admin_id(p_role)
                or ((p_queue.queue_consumers is null
                     or pgque._in_roles(p_role, p_queue.queue_consumers))
                    and (p_owner is null or pg_has_role(p_role, p_owner, 'member')
                         or pgque._in_roles(p_role, p_grantees)))));
end
$$;

-- pgque._require_queue(queue, privilege): PQ015 unless the caller may send
-- to ('send') or consume from ('consume') the queue under its grants.
create or replace function pgque._require_queue(p_queue pgque.queue, p_privilege text)
returns void
language plpgsql stable
set search_path = pg_catalog, pg_temp
as $$
declare
    v_roles oid[] := case p_privilege when 'send' then p_queue.queue_senders
                                      else p_queue.queue_consumers end;
    v_caller name;
begin
    if v_roles is null then
        return;  -- no grants of this kind: the role-wide rule applies
    end if;
    v_caller := pgque._caller();
    if pgque._in_roles(pgque._role_id(v_caller), v_roles) or pgque._is_admin(v_caller) then
        return;
    end if;
    raise exception using errcode = 'PQ015',
        message = format('role %s may not %s queue %L', v_caller,
                         case p_privilege when 'send' then 'send to' else 'consume from' end,
                         p_queue.queue_name),
        hint = format('An admin grants it with pgque.grant_queue(%L, %L, %L).',
                      p_queue.queue_name, v_caller, p_privilege);
end
$$;

-- pgque._require_consumer(queue, owner, grantees, consumer): PQ014 unless the
-- caller may use consumer (a plain consumer or a consumer group) of queue:
-- it is an admin, or it passes the queue's 'consume' grants and owns the
-- consumer or was granted it. Cheap on the hot path when the caller is the
-- owner and the queue has no grants: no query is run.
create or replace function pgque._require_consumer(
    p_queue pgque.queue, p_owner oid, p_grantees oid[], p_consumer text)
returns void
language plpgsql stable
set search_path = pg_catalog, pg_temp
as $$
declare
    v_caller name;
begin
    if p_owner is not null then
        -- pgque._caller(), written out: this runs on every receive and ack.
        v_caller := case when current_setting('role') = 'none' then session_user
                         else current_setting('role')::name end;
        if not (pg_has_role(v_caller, p_owner, 'member')
                or pgque._in_roles(pgque._role_id(v_caller), p_grantees)
                or pgque._is_admin(v_caller)) then
            raise exception using errcode = 'PQ014',
                message = format('role %s may not use consumer %L of queue %L', v_caller,
                                 pgque._name_for_message(p_consumer), p_queue.queue_name),
                hint = format('It belongs to role %s; its owner or an admin may grant it with '
                              'pgque.grant_consumer(%L, %L, %L).', p_owner::regrole,
                              p_queue.queue_name, pgque._name_for_message(p_consumer), v_caller);
        end if;
    end if;
    if p_queue.queue_consumers is not null then
        perform pgque._require_queue(p_queue, 'consume');
    end if;
end
$$;

-- pgque._grant_role(role, granted): the oid of the role named in a grant or
-- revoke, compared as text (a name type would cut a long argument to 63 bytes
-- and match another role). To revoke from a role dropped since it was
-- granted, which queue_grants shows by its oid, that oid as text is accepted
-- when it is among granted and names no role. PQ016 otherwise.
create or replace function pgque._grant_role(p_role text, p_granted oid[] default null)
returns oid
language plpgsql stable
set search_path = pg_catalog, pg_temp
as $$
declare
    v_oid oid := (select r.oid from pg_roles r where r.rolname::text = p_role);
begin
    if v_oid is null and p_role ~ '^[0-9]{1,10}$' and p_role::bigint <= 4294967295
       and p_role::bigint::oid = any(coalesce(p_granted, '{}'))
       and not exists (select 1 from pg_roles r where r.oid = p_role::bigint::oid) then
        v_oid := p_role::bigint::oid;
    end if;
    if v_oid is null then
        raise exception using errcode = 'PQ016',
            message = format('role %L does not exist', pgque._name_for_message(p_role));
    end if;
    return v_oid;
end
$$;

-- pgque._change_queue_grant(queue, role, privilege, add): adds role to (or
-- removes it from) the roles granted privilege ('send' or 'consume') on the
-- queue; returns whether that changed anything. An empty list becomes null:
-- no restriction. The queue row is locked first, so concurrent changes queue
-- up. PQ001 (unknown queue), PQ016 (unknown role or privilege; on revoke, a
-- dropped role may be named by the oid queue_grants shows).
create or replace function pgque._change_queue_grant(
    p_queue text, p_role text, p_privilege text, p_add boolean)
returns boolean
language plpgsql
set search_path = pg_catalog, pg_temp
as $$
declare
    v_queue pgque.queue;
    v_before oid[];
    v_role oid;
    v_after oid[];
begin
    if p_privilege is null or p_privilege not in ('send', 'consume') then
        raise exception using errcode = 'PQ016',
            message = format('privilege must be ''send'' or ''consume'', not %L',
                             pgque._name_for_message(p_privilege));
    end if;
    select * into v_queue from pgque.queue where queue_id = (pgque._queue_row(p_queue)).queue_id
       for no key update;
    v_before := case p_privilege when 'send' then v_queue.queue_senders
                                 else v_queue.queue_consumers end;
    v_role := pgque._grant_role(p_role, case when not p_add then v_before end);
    if (v_role = any(coalesce(v_before, '{}'))) = p_add then
        return false;  -- granted already, or not granted at all
    end if;
    v_after := case when p_add then coalesce(v_before, '{}') || v_role
                    else nullif(array_remove(v_before, v_role), '{}') end;
    if p_privilege = 'send' then
        update pgque.queue set queue_senders = v_after where queue_id = v_queue.queue_id;
    else
        update pgque.queue set queue_consumers = v_after where queue_id = v_queue.queue_id;
    end if;
    return true;
end
$$;

-- pgque.grant_queue(queue, role, privilege): restricts privilege ('send' or
-- 'consume') on the queue to the roles granted it, adding role; true when
-- role was not granted it yet. Admins only. Raises PQ001 (unknown queue),
-- PQ016 (unknown role or privilege).
create or replace function pgque.grant_queue(p_queue text, p_role text, p_privilege text)
returns boolean
language sql
security definer
set search_path = pg_catalog, pg_temp
set jit = off
as $$ select pgque._change_queue_grant(p_queue, p_role, p_privilege, true) $$;

-- pgque.revoke_queue(queue, role, privilege): takes privilege on the queue
-- back from role; true when role had it. When the last grant of a kind goes,
-- the queue is open again to every role of that kind (pgque_writer for
-- 'send', pgque_reader for 'consume'). Admins only.
create or replace function pgque.revoke_queue(p_queue text, p_role text, p_privilege text)
returns boolean
language sql
security definer
set search_path = pg_catalog, pg_temp
set jit = off
as $$ select pgque._change_queue_grant(p_queue, p_role, p_privilege, false) $$;

-- pgque.queue_grants(queue): the roles granted each privilege on the queue,
-- one row per (privilege, role); none when the queue is unrestricted.
create or replace function pgque.queue_grants(p_queue text)
returns table (privilege text, role_name text)
language sql stable
security definer
set search_path = pg_catalog, pg_temp
set jit = off
as $$
    select g.privilege, coalesce(r.rolname::text, g.role::text)
      from pgque._queue_row(p_queue) q
     cross join lateral (select 'send' as privilege, unnest(q.queue_senders) as role
                         union all
                         select 'consume', unnest(q.queue_consumers)) g
      left join pg_roles r on r.oid = g.role
     order by 1, 2
$$;

-- pgque._change_consumer_grant(queue, consumer, role, add): adds role to (or
-- removes it from) the grantees of consumer: the plain consumer and the
-- consumer group of that name, those of them the caller owns (or all, for an
-- admin). Returns whether anything changed; PQ002 when there is no such
-- consumer, PQ014 when the caller owns none of them, PQ016 for an unknown
-- role (on revoke, a dropped role may be named by the oid queue grants show).
create or replace function pgque._change_consumer_grant(
    p_queue text, p_consumer text, p_role text, p_add boolean)
returns boolean
language plpgsql
set search_path = pg_catalog, pg_temp
as $$
declare
    v_queue pgque.queue := pgque._queue_row(p_queue);
    v_caller name := pgque._caller();
    v_admin boolean := pgque._is_admin(v_caller);
    v_found boolean := false;
    v_subs integer[];
    v_groups integer[];
    v_granted oid[];
    v_role oid;
    v_changed integer;
    v_total integer := 0;
begin
    select coalesce(bool_or(true), false) or v_found,
           array_agg(s.sub_id) filter (where v_admin or pg_has_role(v_caller, s.sub_owner, 'member')),
           array_agg(g) filter (where v_admin or pg_has_role(v_caller, s.sub_owner, 'member'))
      into v_found, v_subs, v_granted
      from pgque.subscription s
      left join lateral unnest(s.sub_grantees) g on true
     where s.sub_queue = v_queue.queue_id and s.sub_consumer = p_consumer
       and position('#' in p_consumer) = 0 and s.sub_owner is not null;
    select coalesce(bool_or(true), false) or v_found,
           array_agg(c.cg_id) filter (where v_admin or pg_has_role(v_caller, c.cg_owner, 'member')),
           v_granted || array_agg(g) filter (where v_admin or pg_has_role(v_caller, c.cg_owner, 'member'))
      into v_found, v_groups, v_granted
      from pgque.consumer_group c
      left join lateral unnest(c.cg_grantees) g on true
     where c.cg_queue = v_queue.queue_id and c.cg_consumer = p_consumer
       and c.cg_owner is not null;
    v_role := pgque._grant_role(p_role, case when not p_add then v_granted end);
    if not v_found then
        raise exception using errcode = 'PQ002',
            message = format('consumer %L is not subscribed to queue %L (or has no owner)',
                             pgque._name_for_message(p_consumer), v_queue.queue_name);
    end if;
    if cardinality(v_subs) is null and cardinality(v_groups) is null then
        raise exception using errcode = 'PQ014',
            message = format('role %s may not grant consumer %L of queue %L', v_caller,
                             pgque._name_for_message(p_consumer), v_queue.queue_name),
            hint = 'Only the role that owns the consumer, or an admin, may grant or revoke it.';
    end if;
    update pgque.subscription
       set sub_grantees = case when p_add then coalesce(sub_grantees, '{}') || v_role
                               else nullif(array_remove(sub_grantees, v_role), '{}') end
     where sub_id = any(v_subs)
       and (v_role = any(coalesce(sub_grantees, '{}'))) <> p_add;
    get diagnostics v_changed = row_count;
    v_total := v_changed;
    update pgque.consumer_group
       set cg_grantees = case when p_add then coalesce(cg_grantees, '{}') || v_role
                              else nullif(array_remove(cg_grantees, v_role), '{}') end
     where cg_id = any(v_groups)
       and (v_role = any(coalesce(cg_grantees, '{}'))) <> p_add;
    get diagnostics v_changed = row_count;
    return v_total + v_changed > 0;
end
$$;

-- pgque.grant_consumer(queue, consumer, role): lets role (and its members)
-- use consumer (a plain consumer or a consumer group) as its owner does:
-- receive, ack, nack, claim slots, list, replay and purge its dead letters,
-- unsubscribe. True when role was not granted it yet. The owner or an admin
-- only.
create or replace function pgque.grant_consumer(p_queue text, p_consumer text, p_role text)
returns boolean
language sql
security definer
set search_path = pg_catalog, pg_temp
set jit = off
as $$ select pgque._change_consumer_grant(p_queue, p_consumer, p_role, true) $$;

-- pgque.revoke_consumer(queue, consumer, role): takes that access back; true
-- when role had it. A session of role that owns one of the group's slots
-- keeps its lock but is refused (PQ014) at its next call.
create or replace function pgque.revoke_consumer(p_queue text, p_consumer text, p_role text)
returns boolean
language sql
security definer
set search_path = pg_catalog, pg_temp
set jit = off
as $$ select pgque._change_consumer_grant(p_queue, p_consumer, p_role, false) $$;
