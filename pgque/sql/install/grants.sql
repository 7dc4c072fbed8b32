-- pgque: privileges.
--
-- Callers never touch pgque's tables: they call functions that run as the
-- installer (SECURITY DEFINER, with search_path pinned to pg_catalog), and
-- read the info views. Execution is revoked from PUBLIC and granted by role:
--   pgque_writer  send events
--   pgque_reader  subscribe, receive, ack, nack, read the info views, list,
--                 replay and purge the dead letters of consumers it may use
--   pgque_admin   everything, including queue management and maintenance
-- Inside that bound, consumers belong to the roles that made them and queues
-- may be restricted per role (see base/access.sql).

revoke all on all routines in schema pgque from public;

-- Tables, sequences and views: revoked only where the ACL is still the default
-- (null) or names PUBLIC. Rewriting every table's catalog row on every run
-- would race maintenance's TRUNCATE and drop_queue, which update the same
-- rows ("tuple concurrently updated"); after its first install, a table is
-- left alone.
do $revoke$
declare
    v_relation text;
begin
    for v_relation in
        select case c.relkind when 'S' then 'sequence ' else 'table ' end
               || c.oid::pg_catalog.regclass::text
          from pg_catalog.pg_class c
         where c.relnamespace = 'pgque'::pg_catalog.regnamespace
           and c.relkind in ('r', 'p', 'S', 'v')
           and (c.relacl is null
                or exists (select 1 from pg_catalog.aclexplode(c.relacl) a where a.grantee = 0)) loop
        execute pg_catalog.format('revoke all on %s from public', v_relation);
    end loop;
end
$revoke$;

do $grants$
declare
    v_writer text[] := array[
        'send(text,text,text,text)', 'send(text,text,jsonb,text)',
        'send_batch(text,text[],text[],text[])',
        'send_with(text,text,text,text,timestamptz,interval,text)',
        'send_batch_with(text,text[],text[],text[],timestamptz[],interval[],text[])', 'version()',
        'pin_session(text)', 'session_checked(text,integer,text)'];
    v_reader text[] := array[
        'subscribe(text,text)', 'unsubscribe(text,text)', 'receive(text,text,integer)',
        'ack(text,text,bigint)', 'nack(text,text,bigint,bigint[],interval,text)',
        'ack(text,text,bigint,bigint[],text[],interval)',
        'pin_session(text)', 'session_checked(text,integer,text)',
        'queue_config(text)', 'dead_letters(text,text,integer,bigint)',
        'replay_dead_letter(text,bigint,boolean)',
        'replay_dead_letters(text,text,text,text,interval,text,boolean,boolean)',
        'purge_dead_letters_where(text,text,text,text,interval,text,boolean)', 'purge_dead_letters(text,text,bigint[])', 'version()',
        'get_queue_info(interval)', 'get_consumer_info()',
        'get_partition_slot_status(interval)', 'get_group_info()', 'get_ticker_info()',
        'get_generated_code()',
        'subscribe_slots(text,text,integer,text)', 'subscribe_slot(text,text,integer,integer)',
        'set_failure_policy(text,text,text,integer,interval,integer)', 'failure_policy(text,text)',
        'blocked_keys(text,text)', 'retry_head(text,text,text)',
        'skip_head(text,text,text,text)', 'resume_key(text,text,text)',
        'unsubscribe_slots(text,text)', 'slot_lock_key(text,text,integer)',
        'claim_slot(text,text,integer)', 'release_slot(text,text,integer)',
        'receive_partitioned(text,text,integer,integer,integer)',
        'ack_partitioned(text,text,integer,integer,bigint)',
        'ack_partitioned(text,text,integer,integer,bigint,bigint[],text[],interval)',
        'nack_partitioned(text,text,integer,integer,bigint,bigint[],interval,text)',
        'ack_receive_partitioned(text,text,integer,integer,bigint,bigint[],text[],interval,integer)',
        'ack_receive_partitioned(text,text,integer,integer,bigint,bigint[],text[],interval,interval[],bigint[],integer)',
        'ack_partitioned(text,text,integer,integer,bigint,bigint[],text[],interval,interval[],bigint[])',
        'ack(text,text,bigint,bigint[],text[],interval,interval[],bigint[])',
        'join_group(text,text)', 'group_status(text,text)', 'pending_slots(text,text)',
        'leased(text,text)', 'take_lease(text,text,text,boolean)', 'renew_lease(text)', 'renew_leases(text[])',
        'end_lease(text)', 'set_ownership(text,text,text,interval)', 'ticker_lease()',
        'receive_slots(text,text,integer,integer[],integer)',
        'ack_slots(text,text,integer,integer[],bigint[])',
        'ack_receive_slots(text,text,integer,integer[],bigint[],integer[],integer)',
        'slot_of(text,integer)',
        'max_slots()', 'tick_channel(text)',
        'grant_consumer(text,text,text)', 'revoke_consumer(text,text,text)',
        'queue_grants(text)', 'check_fence(text,text,integer,bigint)',
        'start_recording(text,text,integer)',
        'record_handling(text,text,integer,text,jsonb)',
        'forget_handling(text,text,integer)', 'handling_summary(text,text,timestamptz)',
        'verify_handling(text,text,timestamptz,interval)', 'key_lag(text,text,integer)',
        'metrics()', 'slot_skew(text,text,interval)'];
    v_fn text;
begin
    if exists (select 1 from pg_catalog.pg_roles where rolname = 'pgque_writer') then
        execute 'grant usage on schema pgque to pgque_writer';
        foreach v_fn in array v_writer loop
            execute pg_catalog.format('grant execute on function pgque.%s to pgque_writer', v_fn);
        end loop;
    end if;
    if exists (select 1 from pg_catalog.pg_roles where rolname = 'pgque_reader') then
        execute 'grant usage on schema pgque to pgque_reader';
        foreach v_fn in array v_reader loop
            execute pg_catalog.format('grant execute on function pgque.%s to pgque_reader', v_fn);
        end loop;
        execute 'grant select on pgque.queue_info, pgque.consumer_info, '
                'pgque.partition_slot_status, pgque.group_info, pgque.ticker_info, '
                'pgque.generated_code to pgque_reader';
    end if;
    if exists (select 1 from pg_catalog.pg_roles where rolname = 'pgque_admin') then
        execute 'grant usage on schema pgque to pgque_admin';
        -- Every public function; the internal ones (leading underscore) are
        -- reached only through them.
        for v_fn in select p.oid::regprocedure::text
                      from pg_catalog.pg_proc p
                     where p.pronamespace = 'pgque'::regnamespace and p.proname !~ '^_' loop
            execute pg_catalog.format('grant execute on routine %s to pgque_admin', v_fn);
        end loop;
        execute 'grant select on pgque.queue_info, pgque.consumer_info, '
                'pgque.partition_slot_status, pgque.group_info, pgque.ticker_info, '
                'pgque.generated_code to pgque_admin';
    end if;
end
$grants$;
