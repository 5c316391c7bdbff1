-- Waiting for a run (issue 24): a run that becomes completed, discarded or cancelled is
-- announced on the channel cyclone_mp_runs, its id the payload, so client.wait and
-- client.result wake at once (their one listening connection reads the run then).
-- One trigger catches every path (the completion CAS, a discard, client.cancel, a
-- workflow's refresh) and fires once per statement: the ids of all the runs it ended go
-- in as few notifications as fit (200 ids, 7.4 kB, a notification holds 8 kB).
CREATE FUNCTION cyclone_notify_finished_runs() RETURNS trigger
LANGUAGE plpgsql AS $$
DECLARE
    ids text;
BEGIN
    FOR ids IN
        SELECT string_agg(f.id::text, ',')
          FROM (SELECT n.id, row_number() OVER () - 1 AS i
                  FROM cyclone_finished_new n
                  JOIN cyclone_finished_old o ON o.id = n.id
                 WHERE n.state IN ('completed', 'discarded', 'cancelled')
                   AND o.state IS DISTINCT FROM n.state) f
         GROUP BY f.i / 200
    LOOP
        PERFORM pg_notify('cyclone_mp_runs', ids);
    END LOOP;
    RETURN NULL;
END
$$;

CREATE TRIGGER cyclone_runs_finished
    AFTER UPDATE ON cyclone_runs
    REFERENCING OLD TABLE AS cyclone_finished_old NEW TABLE AS cyclone_finished_new
    FOR EACH STATEMENT EXECUTE FUNCTION cyclone_notify_finished_runs();
