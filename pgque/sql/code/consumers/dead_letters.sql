-- pgque: retries and dead letters.

-- pgque._may_use_consumer_name(queue, name, role): whether role (an oid) may
-- use the subscription of that name on queue: a name without '#' is a plain
-- consumer, one with '#' ("group#k/n", or just "group#") stands for its group.
-- A group named like a plain consumer opens nothing of it.
create or replace function pgque._may_use_consumer_name(
    p_queue pgque.queue, p_consumer text, p_role oid)
returns boolean
language sql stable
set search_path = pg_catalog, pg_temp
as $$
    select exists (select 1 from pgque.subscription s
                    where s.sub_queue = p_queue.queue_id and s.sub_consumer = p_consumer
                      and position('#' in p_consumer) = 0
                      and pgque._may_consume(p_role, p_queue, s.sub_owner, s.sub_grantees))
        or exists (select 1 from pgque.consumer_group g
                    where g.cg_queue = p_queue.queue_id
                      and g.cg_consumer = split_part(p_consumer, '#', 1)
                      and position('#' in p_consumer) > 0
                      and pgque._may_consume(p_role, p_queue, g.cg_owner, g.cg_grantees))
$$;

-- Dead letters belong to the subscription that made them (dl_sub). An admin
-- may list, replay and purge every one. Any other role may do so with those
-- of the subscriptions it may use (it owns the consumer or group, or was
-- granted it: see base/access.sql), within the queue's 'consume' grants. The
-- dead letters of a subscription that is gone are the admins' alone, even once
-- another consumer takes its name: that one is another subscription (and a
-- group subscribed again has new slot subscriptions). Every refusal (PQ015 for
-- the queue, PQ014 for the consumer) is raised before anything changes, and
-- says what the role lacks.

-- pgque._may_use_dead_letters(queue, sub_id, role): whether role (an oid)
-- may list, replay and purge the dead letters that subscription sub_id made:
-- it must still exist and role may use it (its group, for a slot).
create or replace function pgque._may_use_dead_letters(
    p_queue pgque.queue, p_sub_id integer, p_role oid)
returns boolean
language sql stable
set search_path = pg_catalog, pg_temp
as $$
    select exists (select 1 from pgque.subscription s
                    where s.sub_id = p_sub_id and s.sub_queue = p_queue.queue_id
                      and pgque._may_use_consumer_name(p_queue, s.sub_consumer, p_role))
$$;

-- pgque._refuse_dead_letters(queue, action, consumer, gone, dl_id): raises
-- PQ014: the caller may not action ('list', 'replay' or 'purge') the dead
-- letters of consumer (a plain consumer's name, a group's, or a slot
-- subscription's, which stands for its group). The message says what the
-- role lacks: to own the consumer or be granted it, or to be in pgque_admin;
-- when gone (no such consumer is subscribed or, given dl_id, the subscription
-- that made that dead letter was unsubscribed), that only admins may.
create or replace function pgque._refuse_dead_letters(
    p_queue pgque.queue, p_action text, p_consumer text, p_gone boolean,
    p_dl_id bigint default null)
returns void
language plpgsql stable
set search_path = pg_catalog, pg_temp
as $$
declare
    v_caller name := pgque._caller();
    v_name text := pgque._name_for_message(split_part(p_consumer, '#', 1));
    v_owner oid;
begin
    if p_gone and p_dl_id is not null then
        raise exception using errcode = 'PQ014',
            message = format('role %s may not %s dead letter %s of queue %L: consumer %L, which '
                             'made it, was unsubscribed, and the dead letters of an unsubscribed '
                             'consumer are for pgque_admin alone',
                             v_caller, p_action, p_dl_id, p_queue.queue_name, v_name);
    end if;
    if p_gone then
        raise exception using errcode = 'PQ014',
            message = format('role %s may not %s dead letters of consumer %L of queue %L: no such '
                             'consumer is subscribed, and the dead letters of an unsubscribed '
                             'consumer are for pgque_admin alone',
                             v_caller, p_action, v_name, p_queue.queue_name);
    end if;
    v_owner := coalesce(
        (select s.sub_owner from pgque.subscription s
          where s.sub_queue = p_queue.queue_id and s.sub_consumer = p_consumer
            and position('#' in p_consumer) = 0),
        (select g.cg_owner from pgque.consumer_group g
          where g.cg_queue = p_queue.queue_id
            and g.cg_consumer = split_part(p_consumer, '#', 1)));
    raise exception using errcode = 'PQ014',
        message = format('role %s may not %s dead letters of consumer %L of queue %L: it needs to '
                         'own the consumer or be granted it (pgque.grant_consumer), or be in '
                         'pgque_admin', v_caller, p_action, v_name, p_queue.queue_name),
        hint = case when v_owner is not null then
                   format('It belongs to role %s; its owner or an admin may grant it with '
                          'pgque.grant_consumer(%L, %L, %L).', v_owner::regrole,
                          p_queue.queue_name, v_name, v_caller) end;
end
$$;

-- pgque._dead_letter_access(queue, action, consumer): the check every
-- dead-letter function makes first; returns whether the caller is an admin,
-- who may do everything. Any other role must pass the queue's 'consume'
-- grants (PQ015 otherwise) and, when consumer is given, may use the plain
-- consumer or the consumer group of that name (PQ014 otherwise). action
-- ('list', 'replay' or 'purge') is for the messages.
create or replace function pgque._dead_letter_access(
    p_queue pgque.queue, p_action text, p_consumer text default null)
returns boolean
language plpgsql stable
set search_path = pg_catalog, pg_temp
as $$
declare
    v_caller name := pgque._caller();
    v_role oid;
begin
    if pgque._is_admin(v_caller) then
        return true;
    end if;
    v_role := pgque._role_id(v_caller);
    if p_queue.queue_consumers is not null
       and not pgque._in_roles(v_role, p_queue.queue_consumers) then
        raise exception using errcode = 'PQ015',
            message = format('role %s may not %s dead letters of queue %L: it needs to be granted '
                             '''consume'' on the queue (pgque.grant_queue), or be in pgque_admin',
                             v_caller, p_action, p_queue.queue_name),
            hint = format('An admin grants it with pgque.grant_queue(%L, %L, ''consume'').',
                          p_queue.queue_name, v_caller);
    end if;
    -- The name given may be a plain consumer's or a group's.
    if p_consumer is not null
       and not pgque._may_use_consumer_name(p_queue, p_consumer, v_role)
       and not pgque._may_use_consumer_name(p_queue, p_consumer || '#', v_role) then
        perform pgque._refuse_dead_letters(
            p_queue, p_action, p_consumer,
            not exists (select 1 from pgque.subscription s
                         where s.sub_queue = p_queue.queue_id and s.sub_consumer = p_consumer
                           and position('#' in p_consumer) = 0)
            and not exists (select 1 from pgque.consumer_group g
                             where g.cg_queue = p_queue.queue_id
                               and g.cg_consumer = split_part(p_consumer, '#', 1)));
    end if;
    return false;
end
$$;

-- pgque.dead_letters(queue, consumer, limit, after_id): dead letters of a
-- queue (of one consumer, or of every slot of a consumer group, when given),
-- oldest first, after dl_id after_id. A role that is not an admin sees only
-- those of the subscriptions it may use; it is refused (PQ015) by the queue's
-- 'consume' grants, and (PQ014) when it names a consumer it may not use or
-- that is not subscribed.
create or replace function pgque.dead_letters(
    p_queue text, p_consumer text default null, p_limit integer default 100,
    p_after_id bigint default 0)
returns table (dl_id bigint, consumer text, dl_time timestamptz, reason text, ev_id bigint,
               ev_time timestamptz, ev_retry integer, ev_type text, ev_data text,
               ev_extra1 text)
language plpgsql stable
security definer
set search_path = pg_catalog, pg_temp
set jit = off
as $$
declare
    v_queue pgque.queue := pgque._queue_row(p_queue);
    v_admin boolean := pgque._dead_letter_access(v_queue, 'list', p_consumer);
    v_role oid := case when not v_admin then pgque._role_id(pgque._caller()) end;
begin
    return query
        select d.dl_id, d.dl_consumer, d.dl_time, d.dl_reason, d.ev_id, d.ev_time, d.ev_retry,
               d.ev_type, d.ev_data, d.ev_extra1
          from pgque.dead_letter d
         where d.dl_queue = v_queue.queue_id
           and (p_consumer is null or d.dl_consumer = p_consumer
                or split_part(d.dl_consumer, '#', 1) = p_consumer)
           and d.dl_id > coalesce(p_after_id, 0)
           and (v_admin or pgque._may_use_dead_letters(v_queue, d.dl_sub, v_role))
         order by d.dl_id
         limit p_limit;
end
$$;

-- pgque.replay_dead_letter(queue, dl_id, as_next): puts a dead letter back
-- into the log for the consumer that dead-lettered it (same ev_id, type,
-- payload and partition key; retry count back to 0) and removes it from dead
-- letters. Returns the ev_id. With as_next, for a slot of a consumer group,
-- it is not appended to the log but made the next event of its key in its
-- slot, before the key's events the slot has not handed out yet
-- (slots/pause.sql, _hold_first); 22023 for a plain consumer's dead letter or
-- one without a partition key, PQ028 while the key's head is handed out. Admins may replay any; another role those of the
-- subscriptions it may use, within the queue's 'consume' grants. Raises
-- PQ015 (the queue's grants), PQ009 if there is no such dead letter, PQ014
-- if the role may not use its consumer, or the subscription that made it is
-- gone (admins only, then), PQ002 (an admin) if no consumer of its name is
-- subscribed. A refusal changes nothing.
create or replace function pgque.replay_dead_letter(p_queue text, p_dl_id bigint,
                                                    p_as_next boolean default false)
returns bigint
language plpgsql
security definer
set search_path = pg_catalog, pg_temp
set jit = off
as $$
declare
    v_queue pgque.queue := pgque._queue_row(p_queue);
    v_admin boolean := pgque._dead_letter_access(v_queue, 'replay');
    v_dead pgque.dead_letter;
    v_owner integer;
    v record;
begin
    -- Locked first: a concurrent replay of the same dead letter then finds it gone.
    select * into v_dead from pgque.dead_letter d
     where d.dl_queue = v_queue.queue_id and d.dl_id = p_dl_id
       for update;
    if not found then
        raise exception using errcode = 'PQ009',
            message = format('queue %L has no dead letter %s', pgque._name_for_message(p_queue), p_dl_id);
    end if;
    if not v_admin
       and not pgque._may_use_dead_letters(v_queue, v_dead.dl_sub, pgque._role_id(pgque._caller())) then
        perform pgque._refuse_dead_letters(
            v_queue, 'replay', v_dead.dl_consumer,
            not exists (select 1 from pgque.subscription s where s.sub_id = v_dead.dl_sub),
            v_dead.dl_id);
    end if;
    -- The subscription of that name: for a role other than an admin, the one
    -- that made the dead letter (names are unique per queue).
    select sub_id into v_owner from pgque.subscription
     where sub_queue = v_queue.queue_id and sub_consumer = v_dead.dl_consumer;
    if not found then
        raise exception using errcode = 'PQ002',
            message = format('consumer %L is not subscribed to queue %L',
                             pgque._name_for_message(v_dead.dl_consumer), pgque._name_for_message(p_queue));
    end if;
    if p_as_next then
        if position('#' in v_dead.dl_consumer) = 0 or v_dead.ev_extra1 is null then
            raise exception using errcode = '22023',
                message = format('dead letter %s cannot be replayed as the next event of its key: '
                                 '%s', p_dl_id,
                                 case when v_dead.ev_extra1 is null then 'it has no partition key'
                                      else 'it is not a consumer group''s' end);
        end if;
        -- Under the slot's receive lock, as its receive and ack change its keys.
        select * into v from pgque._find_subscription(v_queue, v_dead.dl_consumer, true);
        delete from pgque.dead_letter d where d.dl_id = v_dead.dl_id;
        perform pgque._hold_first(v.sub, v.cur, v_dead);
        return v_dead.ev_id;
    end if;
    delete from pgque.dead_letter d where d.dl_id = v_dead.dl_id;
    execute 'with src as (select $1::bigint as ev_id, $2::timestamptz as ev_time,'
            '                    $3::integer as ev_owner, 0 as ev_retry, $4::text as ev_type,'
            '                    $5::text as ev_data, $6::text as ev_extra1,'
            '                    null::bigint as ev_delayed_id) '
            || pgque._insert_events_sql(v_queue)
      using v_dead.ev_id, v_dead.ev_time, v_owner, v_dead.ev_type, v_dead.ev_data,
            v_dead.ev_extra1;
    perform nextval(v_queue.queue_event_seq);
    if v_queue.queue_ticker_asleep then
        perform pgque._wake_ticker(v_queue.queue_id);
    end if;
    return v_dead.ev_id;
end
$$;

-- pgque.purge_dead_letters(queue, consumer, dl_ids): deletes dead letters of
-- a queue: the given ids, or all (of the consumer or group, when given) when
-- ids is null. Returns how many. Admins may purge any. Another role purges
-- those of the subscriptions it may use, as dead_letters lists them, within
-- the queue's 'consume' grants: PQ015 otherwise, PQ014 for a consumer named
-- that it may not use or that is not subscribed, and PQ014, purging none,
-- when one of the ids given is a dead letter it may not use (also one whose
-- subscription is gone).
create or replace function pgque.purge_dead_letters(
    p_queue text, p_consumer text default null, p_dl_ids bigint[] default null)
returns bigint
language plpgsql
security definer
set search_path = pg_catalog, pg_temp
set jit = off
as $$
declare
    v_queue pgque.queue := pgque._queue_row(p_queue);
    v_admin boolean := pgque._dead_letter_access(v_queue, 'purge', p_consumer);
    v_role oid := case when not v_admin then pgque._role_id(pgque._caller()) end;
    v_dead pgque.dead_letter;
    v_count bigint;
begin
    if not v_admin and p_dl_ids is not null then
        select * into v_dead from pgque.dead_letter d
         where d.dl_queue = v_queue.queue_id and d.dl_id = any(p_dl_ids)
           and (p_consumer is null or d.dl_consumer = p_consumer
                or split_part(d.dl_consumer, '#', 1) = p_consumer)
           and not pgque._may_use_dead_letters(v_queue, d.dl_sub, v_role)
         order by d.dl_id
         limit 1;
        if found then
            perform pgque._refuse_dead_letters(
                v_queue, 'purge', v_dead.dl_consumer,
                not exists (select 1 from pgque.subscription s where s.sub_id = v_dead.dl_sub),
                v_dead.dl_id);
        end if;
    end if;
    delete from pgque.dead_letter d
     where d.dl_queue = v_queue.queue_id
       and (p_consumer is null or d.dl_consumer = p_consumer
            or split_part(d.dl_consumer, '#', 1) = p_consumer)
       and (p_dl_ids is null or d.dl_id = any(p_dl_ids))
       and (v_admin or pgque._may_use_dead_letters(v_queue, d.dl_sub, v_role));
    get diagnostics v_count = row_count;
    return v_count;
end
$$;

-- pgque._dead_letters_where(queue, consumer, ev_type, key, older_than,
-- reason): the ids of the queue's dead letters that match every filter given
-- (null: any): of the consumer or group (as dead_letters names them), of that
-- type and partition key, dead-lettered longer than older_than ago, whose
-- reason contains reason; only those the caller may use (all for an admin).
-- Refuses as dead_letters does (PQ015, PQ014), and 22023 for a negative
-- older_than. Oldest first.
create or replace function pgque._dead_letters_where(
    p_queue pgque.queue, p_action text, p_consumer text, p_ev_type text, p_key text,
    p_older_than interval, p_reason text)
returns setof bigint
language plpgsql stable
set search_path = pg_catalog, pg_temp
as $$
declare
    v_admin boolean := pgque._dead_letter_access(p_queue, p_action, p_consumer);
    v_role oid := case when not v_admin then pgque._role_id(pgque._caller()) end;
begin
    if p_older_than < interval '0' then
        raise exception using errcode = '22023', message = 'older_than must not be negative';
    end if;
    return query
        select d.dl_id from pgque.dead_letter d
         where d.dl_queue = p_queue.queue_id
           and (p_consumer is null or d.dl_consumer = p_consumer
                or split_part(d.dl_consumer, '#', 1) = p_consumer)
           and (p_ev_type is null or d.ev_type = p_ev_type)
           and (p_key is null or d.ev_extra1 = p_key)
           and (p_older_than is null or d.dl_time < now() - p_older_than)
           and (p_reason is null or position(p_reason in coalesce(d.dl_reason, '')) > 0)
           and (v_admin or pgque._may_use_dead_letters(p_queue, d.dl_sub, v_role))
         order by d.dl_id;
end
$$;

-- pgque.replay_dead_letters(queue, consumer, ev_type, key, older_than, reason,
-- as_next, dry_run): replays every dead letter that matches the filters
-- (_dead_letters_where; null: any), as replay_dead_letter does, oldest
-- first (with as_next, newest first, so that each key's come back in their
-- order ahead of its later events); with dry_run, only counts them. Returns
-- how many. All or none: a refusal of any (PQ002, PQ028, 22023) replays none.
create or replace function pgque.replay_dead_letters(
    p_queue text, p_consumer text default null, p_ev_type text default null,
    p_key text default null, p_older_than interval default null, p_reason text default null,
    p_as_next boolean default false, p_dry_run boolean default false)
returns bigint
language plpgsql
security definer
set search_path = pg_catalog, pg_temp
set jit = off
as $$
declare
    v_queue pgque.queue := pgque._queue_row(p_queue);
    v_ids bigint[] := array(select pgque._dead_letters_where(v_queue, 'replay', p_consumer,
                                                             p_ev_type, p_key, p_older_than,
                                                             p_reason));
    v_id bigint;
begin
    if p_dry_run then
        return cardinality(v_ids);
    end if;
    foreach v_id in array case when p_as_next
                               then array(select i from unnest(v_ids) i order by i desc)
                               else v_ids end loop
        perform pgque.replay_dead_letter(p_queue, v_id, p_as_next);
    end loop;
    return cardinality(v_ids);
end
$$;

-- pgque.purge_dead_letters_where(queue, consumer, ev_type, key, older_than,
-- reason, dry_run): deletes every dead letter that matches the filters
-- (_dead_letters_where; null: any); with dry_run, only counts them. Returns
-- how many.
create or replace function pgque.purge_dead_letters_where(
    p_queue text, p_consumer text default null, p_ev_type text default null,
    p_key text default null, p_older_than interval default null, p_reason text default null,
    p_dry_run boolean default false)
returns bigint
language plpgsql
security definer
set search_path = pg_catalog, pg_temp
set jit = off
as $$
declare
    v_queue pgque.queue := pgque._queue_row(p_queue);
    v_ids bigint[] := array(select pgque._dead_letters_where(v_queue, 'purge', p_consumer,
                                                             p_ev_type, p_key, p_older_than,
                                                             p_reason));
begin
    if not p_dry_run then
        delete from pgque.dead_letter d where d.dl_id = any(v_ids);
    end if;
    return cardinality(v_ids);
end
$$;
