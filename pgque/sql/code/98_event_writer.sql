-- pgque: the event writer, written again from the current template.
--
-- See 31_event_writer.sql for what it is. Dropped with the rest of the code
-- (05_drop_code.sql), so written here for the queues there are, waiting for
-- the writer's lock (another transaction's create_queue may be writing it).

do $writer$
begin
    perform pgque._sync_event_writer(true);
end
$writer$;
