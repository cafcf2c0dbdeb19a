// The loss curve: an SVG polyline of every step's loss, the axes' ends labelled (dots with tooltips below 60 steps),
// and the validation losses as squares at their steps (val: [[step, loss], ...]).

// The curve's scale in a w x h box: lo and hi (the losses' range) and x(i), y(v), the pixel position of step i and
// of loss v (the plot spans x 46..w-8 and y 6..h-16; one loss sits at x 46; equal losses at y h-16).
export function lossScale(losses, w, h, val = []) {
  const all = losses.concat(val.map((p) => p[1]));
  const lo = Math.min(...all), hi = Math.max(...all);
  const span = hi - lo || 1;
  const x = (i) => 46 + (losses.length === 1 ? 0 : (i / (losses.length - 1)) * (w - 54));
  const y = (v) => 6 + (1 - (v - lo) / span) * (h - 22);
  return { lo, hi, x, y };
}

export function lossCurve(losses, w, h, val = []) {
  if (!losses.length) return `<div class="hd-empty">no loss reported yet</div>`;
  val = val.filter((p) => p[0] < losses.length);
  const { lo, hi, x, y } = lossScale(losses, w, h, val);
  const squares = val.map(([i, v]) => `<rect class="hd-val" x="${(x(i) - 3).toFixed(1)}" y="${(y(v) - 3).toFixed(1)}" width="6" height="6"><title>step ${i}: validation ${v.toFixed(4)}</title></rect>`).join("");
  const pts = losses.map((v, i) => `${x(i).toFixed(1)},${y(v).toFixed(1)}`).join(" ");
  return `<svg class="hd-loss" width="${w}" height="${h}" role="img" aria-label="loss curve">
    <line x1="46" y1="${h - 16}" x2="${w - 4}" y2="${h - 16}" class="hd-axis"/><line x1="46" y1="4" x2="46" y2="${h - 16}" class="hd-axis"/>
    <text x="42" y="${y(hi) + 4}" text-anchor="end">${hi.toFixed(3)}</text><text x="42" y="${y(lo) + 4}" text-anchor="end">${lo.toFixed(3)}</text>
    <text x="46" y="${h - 3}">step 0</text><text x="${w - 4}" y="${h - 3}" text-anchor="end">step ${losses.length - 1}</text>
    <polyline points="${pts}" class="hd-line"/>${losses.length < 60 ? losses.map((v, i) => `<circle cx="${x(i).toFixed(1)}" cy="${y(v).toFixed(1)}" r="2.2"><title>step ${i}: ${v.toFixed(4)}</title></circle>`).join("") : ""}${squares}</svg>`;
}
