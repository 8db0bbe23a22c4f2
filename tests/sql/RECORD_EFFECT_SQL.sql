INSERT INTO tool_effect (key, run_id, seq, call_index, tool, result, is_error)
VALUES (%(k0)s, %(run_id)s, %(s0)s, %(c0)s, %(t0)s, %(r0)s, %(e0)s)
    ON CONFLICT (key) DO NOTHING