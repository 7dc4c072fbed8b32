-- pgque: retries: nacked events moved back into the log when due.

-- pgque._insert_events_sql(queue): the statement that moves rows of a CTE
-- named "src" into the queue's current event table, keeping ev_id, ev_time,
-- ev_retry, ev_type, ev_data, ev_extra1 (the partition key) and ev_delayed_id,
-- with a new ev_txid (the moving transaction's) and src.ev_owner as the only
-- subscription that sees them.
create or replace function pgque._insert_events_sql(p_queue pgque.queue)
returns text
language sql immutable
set search_path = pg_catalog, pg_temp
as $$
    select format(
        'insert into pgque.%I (ev_id, ev_time, ev_owner, ev_retry, ev_type, ev_data, ev_extra1,'
        '                      ev_delayed_id)'
        ' select ev_id, ev_time, ev_owner, ev_retry, ev_type, ev_data, ev_extra1, ev_delayed_id'
        '   from src order by ev_id',
        pgque._event_table(p_queue.queue_id, p_queue.queue_cur_table))
$$;

-- pgque._retry_waiting: the retries not moved back into the log yet (the rows
-- of pgque.retry_queue that no row of pgque.retry_moved marks).
create or replace view pgque._retry_waiting as
select r.*
  from pgque.retry_queue r
 where not exists (select from pgque.retry_moved m
                    where m.rm_id = r.rq_id and m.rm_part = r.rq_part);

-- pgque._maint_retry(queue): moves every due retry of the queue back into the
-- log in one statement; returns how many. A retry moved is not deleted: a row
-- of pgque.retry_moved marks it (in its partition, emptied with it by the
-- rotation, rotation.sql), and the mark is what makes it moved, so a
-- concurrent mover's retry (its mark's key taken) is left alone. Bumps the
-- event sequence when it moved any, so the ticker sees pending events and
-- ticks them out promptly.
create or replace function pgque._maint_retry(p_queue pgque.queue)
returns bigint
language plpgsql
set search_path = pg_catalog, pg_temp
as $$
declare
    v_count bigint;
begin
    execute 'with due as (select r.* from pgque._retry_waiting r'
            '              where r.ev_queue = $1 and r.ev_retry_after <= now()),'
            '     marked as (insert into pgque.retry_moved (rm_id, rm_part)'
            '                select d.rq_id, d.rq_part from due d'
            '                on conflict do nothing returning rm_id, rm_part),'
            '     src as (select d.* from due d'
            '               join marked m on m.rm_id = d.rq_id and m.rm_part = d.rq_part) '
            || pgque._insert_events_sql(p_queue)
      using p_queue.queue_id;
    get diagnostics v_count = row_count;
    if v_count > 0 then
        perform nextval(p_queue.queue_event_seq);
        if p_queue.queue_ticker_asleep then
            perform pgque._wake_ticker(p_queue.queue_id);  -- ticked at once, not at the next poll
        end if;
    end if;
    return v_count;
end
$$;
