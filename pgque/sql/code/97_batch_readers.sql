-- pgque: every queue's batch reader, written again from the current template.
--
-- See 64_batch_reader.sql for what they are. Unlike the rest of the code they
-- are not dropped first (05_drop_code.sql), but replaced here, each under
-- its queue's maintenance lock, which keeps a concurrent maintenance pass
-- from writing the same reader; the install holds those locks until it
-- commits.

do $readers$
declare
    v_queue_id integer;
begin
    for v_queue_id in select q.queue_id from pgque.queue q order by q.queue_id loop
        perform pgque._lock_queue(v_queue_id, 'maint', true);
        perform pgque._sync_batch_reader(v_queue_id);
    end loop;
end
$readers$;
