-- pgque: retries and dead letters.

-- pgque._insert_events_sql(queue): the statement that moves rows of a CTE
-- named "src" into the queue's current event table, keeping ev_id, ev_time,
-- ev_retry, ev_type, ev_data and ev_extra1 (the partition key), with a new ev_txid (the moving
-- transaction's) and src.ev_owner as the only subscription that sees them.
create or replace function pgque._insert_events_sql(p_queue pgque.queue)
returns text
language sql immutable
set search_path = pg_catalog, pg_temp
as $$
    select format(
        'insert into pgque.%I (ev_id, ev_time, ev_owner, ev_retry, ev_type, ev_data, ev_extra1)'
        ' select ev_id, ev_time, ev_owner, ev_retry, ev_type, ev_data, ev_extra1'
        '   from src order by ev_id',
        pgque._event_table(p_queue.queue_id, p_queue.queue_cur_table))
$$;

-- pgque._maint_retry(queue): moves every due retry of the queue back into the
-- log in one statement; returns how many. Bumps the event sequence when it
-- moved any, so the ticker sees pending events and ticks them out promptly.
create or replace function pgque._maint_retry(p_queue pgque.queue)
returns bigint
language plpgsql
set search_path = pg_catalog, pg_temp
as $$
declare
    v_count bigint;
begin
    execute 'with src as (delete from pgque.retry_queue'
            '              where ev_queue = $1 and ev_retry_after <= now()'
            '          returning *) '
            || pgque._insert_events_sql(p_queue)
      using p_queue.queue_id;
    get diagnostics v_count = row_count;
    if v_count > 0 then
        perform nextval(p_queue.queue_event_seq);
    end if;
    return v_count;
end
$$;

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

-- pgque._may_read_dead_letters(queue, sub_id, role): whether role (an oid)
-- may read the dead letters that subscription sub_id made: it must still
-- exist and role may use it (its group, for a slot). Dead letters of a
-- consumer that is gone belong to the admins only, even once another consumer
-- takes its name: that one is another subscription (and a group subscribed
-- again has new slot subscriptions).
create or replace function pgque._may_read_dead_letters(
    p_queue pgque.queue, p_sub_id integer, p_role oid)
returns boolean
language sql stable
set search_path = pg_catalog, pg_temp
as $$
    select exists (select 1 from pgque.subscription s
                    where s.sub_id = p_sub_id and s.sub_queue = p_queue.queue_id
                      and pgque._may_use_consumer_name(p_queue, s.sub_consumer, p_role))
$$;

-- pgque.dead_letters(queue, consumer, limit, after_id): dead letters of a
-- queue (of one consumer, or of every slot of a consumer group, when given),
-- oldest first, after dl_id after_id. A role that is not an admin sees only
-- those of the consumers it may use, and is refused (PQ014) when it names
-- one it may not (or one that no longer exists).
create or replace function pgque.dead_letters(
    p_queue text, p_consumer text default null, p_limit integer default 100,
    p_after_id bigint default 0)
returns table (dl_id bigint, consumer text, dl_time timestamptz, reason text, ev_id bigint,
               ev_time timestamptz, ev_retry integer, ev_type text, ev_data text,
               ev_extra1 text)
language plpgsql stable
security definer
set search_path = pg_catalog, pg_temp
as $$
declare
    v_queue pgque.queue := pgque._queue_row(p_queue);
    v_caller name := pgque._caller();
    v_admin boolean := pgque._is_admin(v_caller);
    v_role oid := pgque._role_id(v_caller);
begin
    if not v_admin then
        perform pgque._require_queue(v_queue, 'consume');
        -- The name given may be a plain consumer's or a group's.
        if p_consumer is not null
           and not pgque._may_use_consumer_name(v_queue, p_consumer, v_role)
           and not pgque._may_use_consumer_name(v_queue, p_consumer || '#', v_role) then
            raise exception using errcode = 'PQ014',
                message = format('role %s may not read the dead letters of consumer %L of queue %L',
                                 v_caller, pgque._name_for_message(p_consumer), v_queue.queue_name),
                hint = 'Only roles that may use the consumer (its owner, roles it was granted to) '
                       'and admins may; the dead letters of a consumer that is gone, admins only.';
        end if;
    end if;
    return query
        select d.dl_id, d.dl_consumer, d.dl_time, d.dl_reason, d.ev_id, d.ev_time, d.ev_retry,
               d.ev_type, d.ev_data, d.ev_extra1
          from pgque.dead_letter d
         where d.dl_queue = v_queue.queue_id
           and (p_consumer is null or d.dl_consumer = p_consumer
                or split_part(d.dl_consumer, '#', 1) = p_consumer)
           and d.dl_id > coalesce(p_after_id, 0)
           and (v_admin or pgque._may_read_dead_letters(v_queue, d.dl_sub, v_role))
         order by d.dl_id
         limit p_limit;
end
$$;

-- pgque.replay_dead_letter(queue, dl_id): puts a dead letter back into the
-- log for the consumer that dead-lettered it (same ev_id, type, payload and
-- partition key; retry count back to 0) and removes it from dead letters. Returns
-- the ev_id. Raises PQ009 if there is no such dead letter, PQ002 if its
-- consumer is no longer subscribed.
create or replace function pgque.replay_dead_letter(p_queue text, p_dl_id bigint)
returns bigint
language plpgsql
security definer
set search_path = pg_catalog, pg_temp
as $$
declare
    v_queue pgque.queue := pgque._queue_row(p_queue);
    v_dead pgque.dead_letter;
    v_owner integer;
begin
    delete from pgque.dead_letter where dl_queue = v_queue.queue_id and dl_id = p_dl_id
    returning * into v_dead;
    if not found then
        raise exception using errcode = 'PQ009',
            message = format('queue %L has no dead letter %s', pgque._name_for_message(p_queue), p_dl_id);
    end if;
    select sub_id into v_owner from pgque.subscription
     where sub_queue = v_queue.queue_id and sub_consumer = v_dead.dl_consumer;
    if not found then
        raise exception using errcode = 'PQ002',
            message = format('consumer %L is not subscribed to queue %L',
                             pgque._name_for_message(v_dead.dl_consumer), pgque._name_for_message(p_queue));
    end if;
    execute 'with src as (select $1::bigint as ev_id, $2::timestamptz as ev_time,'
            '                    $3::integer as ev_owner, 0 as ev_retry, $4::text as ev_type,'
            '                    $5::text as ev_data, $6::text as ev_extra1) '
            || pgque._insert_events_sql(v_queue)
      using v_dead.ev_id, v_dead.ev_time, v_owner, v_dead.ev_type, v_dead.ev_data,
            v_dead.ev_extra1;
    perform nextval(v_queue.queue_event_seq);
    return v_dead.ev_id;
end
$$;

-- pgque.purge_dead_letters(queue, consumer, dl_ids): deletes dead letters of
-- a queue: the given ids, or all (of the consumer or group, when given) when
-- ids is null. Returns how many.
create or replace function pgque.purge_dead_letters(
    p_queue text, p_consumer text default null, p_dl_ids bigint[] default null)
returns bigint
language plpgsql
security definer
set search_path = pg_catalog, pg_temp
as $$
declare
    v_queue pgque.queue := pgque._queue_row(p_queue);
    v_count bigint;
begin
    delete from pgque.dead_letter
     where dl_queue = v_queue.queue_id
       and (p_consumer is null or dl_consumer = p_consumer
            or split_part(dl_consumer, '#', 1) = p_consumer)
       and (p_dl_ids is null or dl_id = any(p_dl_ids));
    get diagnostics v_count = row_count;
    return v_count;
end
$$;
