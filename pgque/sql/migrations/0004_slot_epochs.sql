-- Migration 4 (pgque 0.2.0): fencing epochs for slot owners (see
-- code/slots/fence.sql).
--
-- Epochs come from one sequence, so they only grow, across every slot and
-- every subscription a slot ever had. A slot gets its row on the first
-- receive of its first owner; the slots that exist have none yet.
create sequence if not exists pgque.epoch_seq;

-- One row per slot subscription that was ever received from: its current
-- epoch and the session that took it (the pid, and when that backend started,
-- since pids are reused). sc_pid is null once that session released the slot.
create table if not exists pgque.slot_claim (
    sc_sub           integer primary key references pgque.subscription on delete cascade,
    sc_epoch         bigint not null,
    sc_pid           integer,
    sc_backend_start timestamptz,
    sc_time          timestamptz not null default now()
);
