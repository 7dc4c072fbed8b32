-- pgque: routines of earlier versions that this one no longer has.
--
-- Dropped so that an upgraded install is the same as a fresh one (the
-- internal ones were never granted to anybody), and only when present:
-- DROP ... IF EXISTS would print a notice at every install.

do $retired$
declare
    v_routine text;
begin
    foreach v_routine in array array[
        -- First keys of advisory locks on constants, which any role that can
        -- connect could hold to stall ticks, maintenance, slots, groups or the
        -- ticker election: rows of pgque's tables and random keys replace them.
        'pgque._tick_lock_class()', 'pgque._maint_lock_class()',
        'pgque._slot_lock_class()', 'pgque._group_lock_class()', 'pgque._ticker_lock_key()',
        'pgque._holds_lock(bigint,integer,text)', 'pgque._holds_slot(integer)',
        -- Folded into pgque._plain_sub.
        'pgque._refuse_slot(pgque.subscription)'] loop
        if pg_catalog.to_regprocedure(v_routine) is not null then
            execute pg_catalog.format('drop routine %s', v_routine);
        end if;
    end loop;
end
$retired$;
