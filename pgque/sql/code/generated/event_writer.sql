-- pgque: the event writer, so that a send plans nothing.
--
-- A queue's event tables are named after its id, so send's INSERT used to be
-- dynamic SQL: parsed, analysed and planned on every call, about 30 µs of
-- server time in a transaction of one event, where the same INSERT written
-- statically costs 10. PL/pgSQL can call only a function whose name it knows
-- when it is compiled, so the writer is one function for every queue:
-- pgque._write_event, generated from pgque.queue, holding each event table's
-- INSERT as static SQL (prepared once per session, its plan kept until the
-- table changes). It picks the queue in a binary tree of IFs on the queue id,
-- then the table, so a send through it costs about the same whatever the
-- number of queues it holds.
--
-- It holds the first queues by id up to 512 event tables
-- (_event_writer_max_tables; about 170 queues of the default 3): each
-- session compiles the writer again at its first send after every change of
-- it, about 40 ms at 768 tables and 0.5 s at 3,000. A queue or table the
-- writer does not know (one beyond those, or one made since the writer was
-- last written) gets null back, and send inserts with dynamic SQL as before:
-- slower, never wrong.
--
-- It follows the protocol of generated code (generator.sql): create_queue and
-- drop_queue write it again when the generators' lock is free, and leave it
-- otherwise to maintenance (pgque.maint() of every queue, which the Ticker
-- runs every second, step `event_writer`); every install writes it. Generated
-- from integers only: no caller text.

-- pgque._event_writer_branches(queue_ids, table_counts, depth): the writer's
-- code for these queues, ascending by id: a binary tree of IFs on the queue
-- id down to a few queues, then one IF per queue and one per event table,
-- each with its static INSERT. Indented for depth.
create or replace function pgque._event_writer_branches(
    p_queue_ids integer[], p_table_counts integer[], p_depth integer)
returns text
language plpgsql immutable
set search_path = pg_catalog, pg_temp
as $$
declare
    v_count integer := coalesce(cardinality(p_queue_ids), 0);
    v_half integer := v_count / 2;
    v_pad text := repeat('    ', p_depth);
    v_code text := '';
    i integer;
    n integer;
begin
    if v_count > 4 then
        return format(E'%sif p_queue_id < %s then\n%s%selse\n%s%send if;\n',
                      v_pad, p_queue_ids[v_half + 1],
                      pgque._event_writer_branches(p_queue_ids[1:v_half], p_table_counts[1:v_half],
                                                   p_depth + 1),
                      v_pad,
                      pgque._event_writer_branches(p_queue_ids[v_half + 1:],
                                                   p_table_counts[v_half + 1:], p_depth + 1),
                      v_pad);
    end if;
    for i in 1 .. v_count loop
        v_code := v_code || format(E'%sif p_queue_id = %s then\n', v_pad, p_queue_ids[i]);
        for n in 0 .. p_table_counts[i] - 1 loop
            v_code := v_code || format(
                E'%s    if p_table = %s then\n'
                 '%s        %s into v_id;\n'
                 '%s        return v_id;\n'
                 '%s    end if;\n',
                v_pad, n, v_pad,
                pgque._event_insert(p_queue_ids[i], n,
                                    format('coalesce(p_id, nextval(%L::regclass))',
                                           'pgque.' || pgque._event_table(p_queue_ids[i])
                                           || '_id_seq'),
                                    'p_type, p_data, p_key'),
                v_pad, v_pad);
        end loop;
        v_code := v_code || format(E'%s    return null;\n%send if;\n', v_pad, v_pad);
    end loop;
    return v_code;
end
$$;

-- pgque._event_writer_max_tables(): how many event tables the writer holds
-- at most, whole queues only.
create or replace function pgque._event_writer_max_tables()
returns integer
language sql immutable
set search_path = pg_catalog, pg_temp
as $$ select 512 $$;

-- pgque._event_writer_queues(): the queues the writer holds now, ascending
-- by id (as this transaction sees them), with their table counts, and the
-- writer's signature (generator.sql): a digest of both.
create or replace function pgque._event_writer_queues(
    out queue_ids integer[], out table_counts integer[], out signature text)
language sql stable
set search_path = pg_catalog, pg_temp
as $$
    select array_agg(q.queue_id order by q.queue_id),
           array_agg(q.queue_ntables order by q.queue_id),
           pgque._signature(coalesce(string_agg(q.queue_id || ':' || q.queue_ntables, ','
                                                order by q.queue_id), ''))
      from (select t.queue_id, t.queue_ntables,
                   sum(t.queue_ntables) over (order by t.queue_id) as tables
              from pgque.queue t) q
     where q.tables <= pgque._event_writer_max_tables()
$$;

-- pgque._event_writer_signature(): the signature of the writer wanted now.
create or replace function pgque._event_writer_signature()
returns text
language sql stable
set search_path = pg_catalog, pg_temp
as $$
    select w.signature from pgque._event_writer_queues() w
$$;

-- pgque._event_writer_source(): the body of pgque._write_event for the
-- queues _event_writer_queues gives.
create or replace function pgque._event_writer_source()
returns text
language sql stable
set search_path = pg_catalog, pg_temp
as $$
    select format(E'-- For %s queues.\n'
                  'declare\n'
                  '    v_id bigint;\n'
                  'begin\n'
                  '%s'
                  '    return null;  -- an unknown queue: the caller inserts dynamically\n'
                  'end\n',
                  coalesce(cardinality(w.queue_ids), 0),
                  pgque._event_writer_branches(w.queue_ids, w.table_counts, 1))
      from pgque._event_writer_queues() w
$$;

-- pgque._event_writer_due(): whether pgque._write_event is missing or was
-- written for other queues than those there are now (maintenance asks every
-- pass: read-only, no source built).
create or replace function pgque._event_writer_due()
returns boolean
language sql stable
set search_path = pg_catalog, pg_temp
as $$
    select pgque._generated_due('_write_event', pgque._event_writer_signature())
$$;

-- pgque._sync_event_writer(wait): writes pgque._write_event(queue_id, table,
-- type, data, key, id) for the queues there are now unless it is up to date
-- or, without wait, another transaction holds the writer's lock (see the top
-- of this file); returns 1 if it wrote it, else 0. The writer inserts one
-- event into event table `table` of queue `queue_id`, with id as its ev_id
-- (null: the next of the queue's sequence), and returns its ev_id, or returns
-- null for a queue or table it does not hold. Executable by no
-- one but the owner, like the writer.
create or replace function pgque._sync_event_writer(p_wait boolean)
returns integer
language plpgsql
set search_path = pg_catalog, pg_temp
as $$
declare
    v_signature text;
begin
    if not pgque._event_writer_due() then
        return 0;
    end if;
    if not pgque._lock_generators(p_wait) then
        return 0;
    end if;
    -- Due again: a writer that committed while this one looked wrote it.
    v_signature := pgque._event_writer_signature();
    if not pgque._generated_due('_write_event', v_signature) then
        return 0;
    end if;
    perform pgque._write_generated(
        '_write_event',
        'p_queue_id integer, p_table integer, p_type text, p_data text, p_key text, p_id bigint',
        'returns bigint language plpgsql set search_path = pg_catalog, pg_temp',
        v_signature, pgque._event_writer_source());
    return 1;
end
$$;
