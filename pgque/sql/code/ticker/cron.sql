-- pgque: ticking from inside the database with pg_cron.
--
-- An alternative to running a pgque.Ticker (or Workers, which run one) when
-- the pg_cron extension is installed in this database (cron.database_name
-- names it). pg_cron schedules by the minute in most versions, so its job
-- runs pgque.ticker_loop(), which ticks every 100 ms for just under a minute
-- and is started again by the next run. The loop runs in the same election
-- as the Python Ticker (pgque.claim_ticker), so only one of them ticks a
-- database at a time.

-- pgque.ticker_loop(seconds, interval_ms): for about seconds seconds, every
-- interval_ms milliseconds, ticks every queue that has pending events
-- (pgque.ticker()), committing each time, and runs maintenance every second.
-- Returns at once when another ticker holds the election lock.
--
-- A procedure that commits may be neither SECURITY DEFINER nor pin its
-- search_path (PostgreSQL refuses the COMMIT), and it runs with its caller's
-- path: pg_cron's job runs it as the installer with whatever path the job
-- has. So nothing in it is looked up on that path: every function and
-- operator is schema-qualified, and every type is spelled with its SQL
-- keyword (timestamp with time zone, not timestamptz, which a role could
-- shadow with a type of its own in public). Grant EXECUTE to admins only.
create or replace procedure pgque.ticker_loop(
    p_seconds double precision default 58, p_interval_ms integer default 100)
language plpgsql
as $$
declare
    v_until timestamp with time zone := pg_catalog.clock_timestamp()
        operator(pg_catalog.+) pg_catalog.make_interval(secs => p_seconds);
    v_next_maint timestamp with time zone := pg_catalog.clock_timestamp();
    v_after integer;
begin
    if not pgque.claim_ticker() then
        return;
    end if;
    -- A Python Ticker that went away asleep left the queues marked: this loop
    -- never sleeps, so sends must stop notifying (ticker/sleep.sql).
    perform pgque.ticker_wake();
    commit;
    while pg_catalog.clock_timestamp() operator(pg_catalog.<) v_until loop
        -- A few hundred queues a transaction (pgque.ticker_some): one over
        -- thousands would outgrow the lock table.
        v_after := null;
        loop
            select s.last_queue into v_after from pgque.ticker_some(v_after, 500) s;
            exit when v_after is null;
            commit;
        end loop;
        if pg_catalog.clock_timestamp() operator(pg_catalog.>=) v_next_maint then
            perform pgque.maint();
            v_next_maint := pg_catalog.clock_timestamp()
                operator(pg_catalog.+) interval '1 second';
        end if;
        commit;
        perform pg_catalog.pg_sleep(p_interval_ms operator(pg_catalog./) 1000.0);
    end loop;
    perform pgque.release_ticker();
end
$$;

-- pgque.start_cron(): schedules pgque.ticker_loop() every minute with
-- pg_cron (job 'pgque-ticker'), replacing an earlier schedule of that name;
-- returns the job id. Raises PQ030 when pg_cron is not installed here.
create or replace function pgque.start_cron()
returns bigint
language plpgsql
security definer
set search_path = pg_catalog, pg_temp
set jit = off
as $$
declare
    v_job bigint;
begin
    if not exists (select 1 from pg_catalog.pg_extension where extname = 'pg_cron') then
        raise exception using errcode = 'PQ030',
            message = 'pg_cron is not installed in this database',
            hint = 'Add pg_cron to shared_preload_libraries, set cron.database_name to this '
                   'database and CREATE EXTENSION pg_cron; or run pgque.Ticker / workers instead.';
    end if;
    execute 'select cron.schedule($1, $2, $3)'
       into v_job
      using 'pgque-ticker', '* * * * *', 'call pgque.ticker_loop()';
    return v_job;
end
$$;

-- pgque.stop_cron(): removes the 'pgque-ticker' job; true when there was one.
-- A loop already running finishes its minute. Raises PQ030 without pg_cron.
create or replace function pgque.stop_cron()
returns boolean
language plpgsql
security definer
set search_path = pg_catalog, pg_temp
set jit = off
as $$
declare
    v_found boolean;
begin
    if not exists (select 1 from pg_catalog.pg_extension where extname = 'pg_cron') then
        raise exception using errcode = 'PQ030',
            message = 'pg_cron is not installed in this database';
    end if;
    execute 'select exists (select 1 from cron.job where jobname = $1)' into v_found
      using 'pgque-ticker';
    if v_found then
        execute 'select cron.unschedule($1)' using 'pgque-ticker';
    end if;
    return v_found;
end
$$;
