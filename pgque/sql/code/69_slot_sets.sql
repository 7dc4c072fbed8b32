-- pgque: receiving and acking several slots of a group in one call.
--
-- A session that owns many slots (a worker with few lanes, a consumer that
-- drains a whole group) would otherwise make a receive and an ack per slot:
-- two round trips, two commits and the queue and group lookups, times the
-- slots. These do the same per slot, with the same checks, in one statement
-- each, as Kafka's poll returns the records of every assigned partition.
-- Each slot's piece is the one receive_partitioned would return; nothing
-- about order or ownership changes.


-- pgque._slot_subs(queue, group, slots): the subscriptions and cursors of the
-- given slots of the group (validated: each a slot of the group's count, no
-- slot twice: 22023), ascending by slot, read without a lock.
create or replace function pgque._slot_subs(
    p_queue pgque.queue, p_group pgque.consumer_group, p_slots integer[])
returns table (slot integer, sub pgque.subscription, cur pgque.cursor)
language plpgsql stable
set search_path = pg_catalog, pg_temp
as $$
#variable_conflict use_column
declare
    v_slot integer;
begin
    if p_slots is null then
        raise exception using errcode = '22023', message = 'the list of slots must not be null';
    end if;
    foreach v_slot in array p_slots loop
        perform pgque._check_slot(v_slot, p_group.cg_slots);
    end loop;
    if cardinality(p_slots) <> (select count(distinct k) from unnest(p_slots) k) then
        raise exception using errcode = '22023',
            message = format('slots %s name a slot twice', p_slots::text);
    end if;
    for v_slot in select k from unnest(p_slots) k order by k loop
        return query
            select v_slot, f.sub, f.cur
              from pgque._find_subscription(
                       p_queue, pgque._slot_name(p_group.cg_consumer, v_slot, p_group.cg_slots),
                       false) f;
    end loop;
end
$$;

-- pgque.receive_slots(queue, consumer, slots, slot_list, max_events): for each
-- slot of slot_list (slots of a group of slots), what receive_partitioned
-- would return, as rows led by the slot, ascending by slot; slots with
-- nothing to receive return no row. One transaction: a failure (PQ024 for a
-- slot this session does not own) receives nothing. max_events bounds each
-- slot's piece.
create or replace function pgque.receive_slots(
    p_queue text, p_consumer text, p_slots integer, p_slot_list integer[],
    p_max_events integer default null)
returns table (slot integer, batch_id bigint, ev_id bigint, ev_time timestamptz,
               ev_retry integer, ev_type text, ev_data text, ev_extra1 text, epoch bigint)
language plpgsql
security definer
set search_path = pg_catalog, pg_temp
as $$
#variable_conflict use_column
declare
    v_queue pgque.queue := pgque._queue_row(p_queue);
    v_group pgque.consumer_group;
    v record;
begin
    perform pgque._check_max_events(p_max_events);
    perform pgque._check_slot(0, p_slots);
    v_group := pgque._group(v_queue, p_consumer, p_slots);
    for v in select * from pgque._slot_subs(v_queue, v_group, p_slot_list) loop
        return query select v.slot, r.batch_id, r.ev_id, r.ev_time, r.ev_retry, r.ev_type,
                            r.ev_data, r.ev_extra1, r.epoch
                       from pgque._receive_slot(v_queue, v_group, v.slot, v.sub, v.cur,
                                                p_max_events) r;
    end loop;
end
$$;

-- pgque.ack_slots(queue, consumer, slots, slot_list, batch_ids): acks, for each
-- slot of slot_list, the batch piece batch_ids names at the same position
-- (what ack_partitioned does for one), in one transaction, slots locked in
-- ascending order; returns, in the order given, whether each ack finished
-- its batch. Raises 22023 when the lists differ in length, PQ024 for a slot
-- this session does not own, PQ003 for a batch that is not the slot's open
-- one: then nothing is acked.
create or replace function pgque.ack_slots(
    p_queue text, p_consumer text, p_slots integer, p_slot_list integer[],
    p_batch_ids bigint[])
returns boolean[]
language plpgsql
security definer
set search_path = pg_catalog, pg_temp
as $$
declare
    v_queue pgque.queue := pgque._queue_row(p_queue);
    v_group pgque.consumer_group;
    v record;
    v_locked record;
    v_done boolean[] := '{}';
    v_sorted integer[] := array(select k from unnest(p_slot_list) k order by k);
begin
    perform pgque._check_slot(0, p_slots);
    v_group := pgque._group(v_queue, p_consumer, p_slots);
    if p_slot_list is null or p_batch_ids is null then
        raise exception using errcode = '22023',
            message = 'ack_slots: the slots and the batch ids must not be null';
    end if;
    if cardinality(p_slot_list) <> cardinality(p_batch_ids) then
        raise exception using errcode = '22023',
            message = 'ack_slots: the slots and the batch ids must have the same length';
    end if;
    for v in select s.slot, s.sub, b.batch_id
               from pgque._slot_subs(v_queue, v_group, p_slot_list) s
               join unnest(p_slot_list, p_batch_ids) as b(slot, batch_id) on b.slot = s.slot
              order by s.slot loop
        perform pgque._require_owner(v.sub);
        select f.sub, f.cur into v_locked
          from pgque._find_subscription(v_queue, (v.sub).sub_consumer, true) f;
        perform pgque._require_owner(v_locked.sub);
        v_done := v_done || pgque._ack(v_locked.sub, v_locked.cur, v.batch_id);
    end loop;
    -- Back in the order given (v_done is in ascending slot order).
    return array(select v_done[array_position(v_sorted, g.k)]
                   from unnest(p_slot_list) with ordinality as g(k, pos)
                  order by g.pos);
end
$$;
