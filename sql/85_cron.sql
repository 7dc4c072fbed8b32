-- pgque: ticking from inside the database with pg_cron.
--
-- An alternative to running a pgque.Ticker (or Workers, which run one) when
-- the pg_cron extension is installed in this database (cron.database_name
-- names it). pg_cron schedules by the minute in most versions, so its job
-- runs pgque.ticker_loop(), which ticks every 100 ms for just under a minute
-- and is started again by the next run. The loop takes the same advisory lock
-- as the Python Ticker, so only one of them ticks a database at a time.

-- pgque._ticker_lock_key(): the bigint advisory lock that elects the active
-- ticker of a database ('pgqk' << 32, shared with pgque.Ticker in Python).
create or replace function pgque._ticker_lock_key()
returns bigint
language sql immutable
as $$ select 1885827435::bigint << 32 $$;

-- pgque.ticker_loop(seconds, interval_ms): for about seconds seconds, every
-- interval_ms milliseconds, ticks every queue that has pending events
-- (pgque.ticker()), committing each time, and runs maintenance every second.
-- Returns at once when another ticker holds the election lock. A procedure
-- with transaction control may not be SECURITY DEFINER nor pin search_path,
-- so every name in it is schema-qualified; grant EXECUTE to admins only.
create or replace procedure pgque.ticker_loop(
    p_seconds double precision default 58, p_interval_ms integer default 100)
language plpgsql
as $$
declare
    v_until timestamptz := pg_catalog.clock_timestamp()
                           + pg_catalog.make_interval(secs => p_seconds);
    v_next_maint timestamptz := pg_catalog.clock_timestamp();
begin
    if not pg_catalog.pg_try_advisory_lock(pgque._ticker_lock_key()) then
        return;
    end if;
    while pg_catalog.clock_timestamp() < v_until loop
        perform pgque.ticker();
        if pg_catalog.clock_timestamp() >= v_next_maint then
            perform pgque.maint();
            v_next_maint := pg_catalog.clock_timestamp() + interval '1 second';
        end if;
        commit;
        perform pg_catalog.pg_sleep(p_interval_ms / 1000.0);
    end loop;
    perform pg_catalog.pg_advisory_unlock(pgque._ticker_lock_key());
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
