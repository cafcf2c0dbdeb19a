// Formatting of the dashboard's numbers: durations as a clock, token rates, step times, memory.

// Seconds as m:ss or h:mm:ss (rounded, never negative); "–" when unknown.
export function clock(s) {
  if (s == null || !isFinite(s)) return "–";
  s = Math.max(0, Math.round(s));
  const h = Math.floor(s / 3600), m = Math.floor((s % 3600) / 60), sec = s % 60;
  return (h ? `${h}:${String(m).padStart(2, "0")}` : `${m}`) + `:${String(sec).padStart(2, "0")}`;
}

// Tokens per second: tok/s, k tok/s (one decimal), M tok/s (two); "" when unknown.
export function rate(t) {
  if (t == null) return "";
  return t >= 1e6 ? `${(t / 1e6).toFixed(2)}M tok/s` : t >= 1e3 ? `${(t / 1e3).toFixed(1)}k tok/s` : `${t.toFixed(0)} tok/s`;
}

// A step time: seconds with two decimals from 1 s up, else whole milliseconds.
export function secs(t) {
  return t >= 1 ? t.toFixed(2) + " s" : (t * 1e3).toFixed(0) + " ms";
}

// MiB: MiB with one decimal below 102.4, else GiB (one decimal below 10 GiB, none from there); "" when unknown.
export function mem(mb) {
  if (mb == null) return "";
  return mb >= 102.4 ? `${(mb / 1024).toFixed(mb >= 10240 ? 0 : 1)} GiB` : `${mb.toFixed(1)} MiB`;
}

// A measured memory beside its estimate, in one unit chosen by the larger (GiB with two decimals from 102.4 MiB,
// else MiB with one): "0.28 GiB measured / 0.27 GiB est."; the measured figure alone without an estimate; "" when
// nothing was measured.
export function memPair(measured, estimated) {
  if (measured == null) return "";
  if (estimated == null) return mem(measured);
  const gib = Math.max(measured, estimated) >= 102.4;
  const f = (mb) => (gib ? `${(mb / 1024).toFixed(2)} GiB` : `${mb.toFixed(1)} MiB`);
  return `${f(measured)} measured / ${f(estimated)} est.`;
}
