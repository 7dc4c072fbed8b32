-- Migration 3 (pgque 0.2.0): events stop carrying ev_extra2..4.
--
-- They came with PgQ's event shape; no pgque function ever set them, so every
-- value in them is null and nothing is lost. ev_extra1 (the partition key)
-- stays. Dropping a column only marks it dropped in the catalog: no table is
-- rewritten. Each queue's event tables inherit their columns from the queue's
-- parent table (pgque.event_<queue_id>), so dropping them there drops them from
-- its children too. The parent's name is written out here: migrations run
-- before the code (and so pgque._event_table) is created.
alter table pgque.event_template
    drop column if exists ev_extra2, drop column if exists ev_extra3,
    drop column if exists ev_extra4;
alter table pgque.retry_queue
    drop column if exists ev_extra2, drop column if exists ev_extra3,
    drop column if exists ev_extra4;
alter table pgque.dead_letter
    drop column if exists ev_extra2, drop column if exists ev_extra3,
    drop column if exists ev_extra4;
do $drop_extras$
declare
    v_queue_id integer;
begin
    for v_queue_id in select queue_id from pgque.queue order by queue_id loop
        execute format('alter table pgque.%I drop column if exists ev_extra2, '
                       'drop column if exists ev_extra3, drop column if exists ev_extra4',
                       'event_' || v_queue_id::text);
    end loop;
end
$drop_extras$;
