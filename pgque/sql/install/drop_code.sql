-- pgque: drop the stateless part before recreating it.
--
-- Tables hold the state; everything else (functions, procedures, views,
-- composite types) is code, dropped here and created again by the files that
-- follow, on every install and upgrade, generated code included (written again
-- by install/generated.sql). So an upgraded install has exactly a fresh install's
-- code: a routine whose signature changed or that is gone leaves nothing
-- behind. EXECUTE grants go with the routines and install/grants.sql makes them
-- again (grant pgque's roles, not its functions, to keep yours).
--
-- Objects of yours that depend on pgque's code (a view over
-- pgque.consumer_info, a function returning its row type) would go with it:
-- the install refuses (PQ017) and names them instead.
--
-- First the generators' lock (code/generated/generator.sql), held to the
-- install's commit: a generator that is writing its code now finishes first;
-- one that comes later finds the lock taken and leaves its code to the next
-- maintenance pass. Nothing else is locked here, so maintenance goes on while
-- the install waits for a session that reads a view it drops.

lock table pgque.install_lock in share update exclusive mode;

do $code$
declare
    v_schema oid := 'pgque'::regnamespace;
    v_outside text;
    v_object text;
    v_messages text := pg_catalog.current_setting('client_min_messages');
begin
    select string_agg(distinct pg_catalog.format('%s %s', i.type, i.identity), ', ')
      into v_outside
      from pg_catalog.pg_depend d
     cross join lateral pg_catalog.pg_identify_object(d.classid, d.objid, d.objsubid) i
     where d.deptype = 'n'
       and ((d.refclassid = 'pg_catalog.pg_proc'::pg_catalog.regclass
             and d.refobjid in (select p.oid from pg_catalog.pg_proc p
                                 where p.pronamespace = v_schema))
            or (d.refclassid = 'pg_catalog.pg_class'::pg_catalog.regclass
                and d.refobjid in (select c.oid from pg_catalog.pg_class c
                                    where c.relnamespace = v_schema and c.relkind = 'v'))
            -- The row types of views and composite types, and their array
            -- types (a column of pgque.batch_event[] depends on the array).
            or (d.refclassid = 'pg_catalog.pg_type'::pg_catalog.regclass
                and d.refobjid in (select t.oid from pg_catalog.pg_type t
                                     join pg_catalog.pg_class c
                                       on t.oid in (c.reltype, (select a.typarray
                                                                  from pg_catalog.pg_type a
                                                                 where a.oid = c.reltype))
                                    where c.relnamespace = v_schema and c.relkind in ('v', 'c'))))
       -- The schema of the dependent object; a view's rule, a default, a
       -- trigger have none of their own: their table's.
       and case d.classid
               when 'pg_catalog.pg_rewrite'::pg_catalog.regclass then
                   (select c.relnamespace from pg_catalog.pg_rewrite r
                      join pg_catalog.pg_class c on c.oid = r.ev_class where r.oid = d.objid)
               when 'pg_catalog.pg_attrdef'::pg_catalog.regclass then
                   (select c.relnamespace from pg_catalog.pg_attrdef a
                      join pg_catalog.pg_class c on c.oid = a.adrelid where a.oid = d.objid)
               when 'pg_catalog.pg_trigger'::pg_catalog.regclass then
                   (select c.relnamespace from pg_catalog.pg_trigger t
                      join pg_catalog.pg_class c on c.oid = t.tgrelid where t.oid = d.objid)
               when 'pg_catalog.pg_constraint'::pg_catalog.regclass then
                   (select c.connamespace from pg_catalog.pg_constraint c where c.oid = d.objid)
               else (select n.oid from pg_catalog.pg_namespace n where n.nspname = i.schema)
           end is distinct from v_schema;
    if v_outside is not null then
        raise exception using
            errcode = 'PQ017',
            message = pg_catalog.format('pgque cannot replace its views and functions: %s '
                                        'depends on them', v_outside),
            hint = 'Drop those objects, run the install, and create them again.';
    end if;

    -- Quietly: each drop cascades to pgque's own dependent code, and says so.
    perform pg_catalog.set_config('client_min_messages', 'warning', true);
    -- By name from the catalog row, not regclass: a view an earlier drop
    -- cascaded to is gone from the catalog cache, and regclass would print its
    -- number (the loop reads its rows in batches, some after such drops).
    for v_object in
        select pg_catalog.format('pgque.%I', c.relname) from pg_catalog.pg_class c
         where c.relnamespace = v_schema and c.relkind = 'v' loop
        execute pg_catalog.format('drop view if exists %s cascade', v_object);
    end loop;
    for v_object in
        select p.oid::pg_catalog.regprocedure::text from pg_catalog.pg_proc p
         where p.pronamespace = v_schema loop
        -- A routine dropped by an earlier cascade is gone from the catalog by now.
        if pg_catalog.to_regprocedure(v_object) is not null then
            execute pg_catalog.format('drop routine %s cascade', v_object);
        end if;
    end loop;
    for v_object in
        select pg_catalog.format('pgque.%I', c.relname) from pg_catalog.pg_class c
         where c.relnamespace = v_schema and c.relkind = 'c' loop
        execute pg_catalog.format('drop type if exists %s cascade', v_object);
    end loop;
    perform pg_catalog.set_config('client_min_messages', v_messages, true);
end
$code$;
