-- pgque: batch readers, so that reading a batch is not planned on every call.
--
-- A queue's event tables are named after its id, so the statement that reads
-- a batch (_batch_events, consumers/read.sql) is dynamic SQL: parsed and planned at
-- every receive. Over the parent and its three children that planning costs
-- more than the read itself (about 0.6 ms against 0.3 ms for 100 events).
-- So every queue gets a generated function, its batch reader, holding the
-- same statements as static SQL: PL/pgSQL prepares a static statement once
-- per session and keeps its plan until a table it reads changes (a truncate,
-- an index built), so a receive then plans nothing.
--
-- The reader has one branch per slot count: the plain one (no routing
-- filter) and one for each count N above 1 that a group of the queue uses,
-- with N written out as a literal so that the plan can use the slot index
-- (generated/slot_index.sql). For any other count it returns one row of
-- nulls and the caller (_run_reader) reads with dynamic SQL, as
-- before: a reader that lags behind the groups is slower, never wrong. The
-- plain branch is always there. A reader returns its events as rows, which
-- receive hands on as they are (consumers/batch.sql); _run_reader collects
-- them into one array for everyone else.
--
-- Readers follow the protocol of generated code (generator.sql): create_queue
-- writes a queue's first one, maintenance writes it again when its groups'
-- slot counts change, drop_queue drops it (each when the generators' lock is
-- free, else maintenance does it next), every install writes it from the
-- current template. Generated from integers only: no caller text.


-- pgque._batch_reader_name(queue_id): the reader's function name (no schema;
-- internal, as its leading underscore tells install/grants.sql).
create or replace function pgque._batch_reader_name(p_queue_id integer)
returns text
language plpgsql immutable
set search_path = pg_catalog, pg_temp
as $$
begin
    return '_batch_reader_' || p_queue_id::text;
end
$$;

-- pgque._batch_reader_args(): the reader's parameter list: one read request
-- (pgque.read_request, consumers/read.sql), whose slot count picks the branch.
create or replace function pgque._batch_reader_args()
returns text
language sql immutable
set search_path = pg_catalog, pg_temp
as $$
    select 'p_read pgque.read_request'
$$;

-- pgque._batch_reader_source(queue_id, slot_counts): the body of the queue's
-- reader for the given slot counts above 1: for each count, and for plain
-- consumers and groups of one slot, what _read_dispatch writes for it (its
-- probe, its span reads and its read, here static).
create or replace function pgque._batch_reader_source(p_queue_id integer, p_slot_counts integer[])
returns text
language sql immutable
set search_path = pg_catalog, pg_temp
as $$
    select format(E'-- For slot counts %s.\n'
                  'declare\n'
                  '    p_slots constant integer := p_read.slots;\n'
                  'begin\n'
                  '%s'
                  '    -- No branch for this slot count: the caller reads dynamically.\n'
                  '    return query select (null::pgque.event_template).*;\n'
                  'end\n',
                  array_to_string(array_prepend(1, p_slot_counts), ', '),
                  string_agg(format(E'    if p_slots %s then\n%s    end if;\n',
                                    case when n = 1 then 'is null or p_slots = 1'
                                         else '= ' || n::text end,
                                    regexp_replace(pgque._read_dispatch('p_read', p_queue_id, n),
                                                   E'^(?=.)', '        ', 'gn')),
                             '' order by n))
      from unnest(array_prepend(1, p_slot_counts)) n
$$;

-- pgque._batch_reader_signature(queue_id): the signature of the queue's
-- reader wanted now: for its groups' slot counts.
create or replace function pgque._batch_reader_signature(p_queue_id integer)
returns text
language sql stable
set search_path = pg_catalog, pg_temp
as $$
    select pgque._signature(p_queue_id || ':' || pgque._slot_counts_wanted(p_queue_id)::text)
$$;

-- pgque._batch_reader_due(queue_id): whether the queue's reader is missing
-- or was written for other slot counts than its groups use now. Read-only
-- (for _maint_due).
create or replace function pgque._batch_reader_due(p_queue_id integer)
returns boolean
language sql stable
set search_path = pg_catalog, pg_temp
as $$
    select pgque._generated_due(pgque._batch_reader_name(p_queue_id),
                                pgque._batch_reader_signature(p_queue_id))
$$;

-- pgque._sync_batch_reader(queue_id, wait): writes the queue's reader for
-- its groups' slot counts unless it is current or (without wait) the
-- generators' lock is taken; returns 1 if it wrote it, else 0.
create or replace function pgque._sync_batch_reader(p_queue_id integer, p_wait boolean)
returns integer
language plpgsql
set search_path = pg_catalog, pg_temp
as $$
declare
    v_signature text;
begin
    if not pgque._batch_reader_due(p_queue_id) or not pgque._lock_generators(p_wait) then
        return 0;
    end if;
    -- Read once locked: what a writer that committed meanwhile wrote counts.
    v_signature := pgque._batch_reader_signature(p_queue_id);
    if not pgque._generated_due(pgque._batch_reader_name(p_queue_id), v_signature) then
        return 0;
    end if;
    perform pgque._write_generated(
        pgque._batch_reader_name(p_queue_id), pgque._batch_reader_args(),
        'returns setof pgque.event_template language plpgsql stable'
        ' set search_path = pg_catalog, pg_temp set plan_cache_mode = force_generic_plan',
        v_signature,
        pgque._batch_reader_source(p_queue_id, pgque._slot_counts_wanted(p_queue_id)));
    return 1;
end
$$;

-- pgque._orphan_readers(): the names of the batch readers whose queue is
-- gone (drop_queue drops its reader only when the generators' lock is free).
create or replace function pgque._orphan_readers()
returns setof text
language sql stable
set search_path = pg_catalog, pg_temp
as $$
    select p.proname::text from pg_proc p
     where p.pronamespace = 'pgque'::regnamespace and p.proname ~ '^_batch_reader_[0-9]+$'
       and not exists (select from pgque.queue q
                        where pgque._batch_reader_name(q.queue_id) = p.proname)
     order by 1
$$;

-- pgque._drop_orphan_readers(wait): drops the readers of dropped queues
-- under the generators' lock (without wait, only when it is free); returns
-- how many.
create or replace function pgque._drop_orphan_readers(p_wait boolean)
returns integer
language plpgsql
set search_path = pg_catalog, pg_temp
as $$
declare
    v_name text;
    v_dropped integer := 0;
begin
    if not exists (select from pgque._orphan_readers()) or not pgque._lock_generators(p_wait) then
        return 0;
    end if;
    for v_name in select * from pgque._orphan_readers() loop
        perform pgque._drop_generated(v_name);
        v_dropped := v_dropped + 1;
    end loop;
    return v_dropped;
end
$$;
