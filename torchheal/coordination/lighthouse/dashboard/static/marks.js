/* torchheal lighthouse dashboard: what is drawn behind the committed-steps/s chart.
 *
 * A uPlot plugin, kept apart from app.js (which renders the rest of the page): failures shade
 * the chart (red while the job stalled, amber while the lost group was down, until it healed),
 * and a divergence (a group's guard found groups holding different state) is a red line at the
 * quorum where that group's mismatch count rose, labelled with the group and its step.
 */
"use strict";
window.torchhealMarks = function (getStatus) {
  function drawBands(u, s) {
    const ctx = u.ctx;
    const { top, height } = u.bbox;
    for (const f of s.failures) {
      const wentOn = f.went_on || s.now;
      const healed = f.healed || s.now;
      const spans = [[f.last_in_quorum, wentOn, "rgba(198,47,47,0.22)"], [wentOn, healed, "rgba(184,110,0,0.12)"]];
      for (const [a, b, fill] of spans) {
        const x0 = u.valToPos(a, "x", true);
        const x1 = u.valToPos(b, "x", true);
        if (!isFinite(x0) || !isFinite(x1) || x1 <= x0) continue;
        ctx.fillStyle = fill;
        ctx.fillRect(x0, top, Math.max(1, x1 - x0), height);
      }
    }
  }

  function drawDivergences(u, s) {
    const ctx = u.ctx;
    const { left, top, width, height } = u.bbox;
    const dpr = window.devicePixelRatio || 1;
    ctx.strokeStyle = "rgb(198,47,47)";
    ctx.fillStyle = "rgb(198,47,47)";
    ctx.lineWidth = 2 * dpr;
    ctx.font = `${11 * dpr}px sans-serif`;
    for (const d of s.divergences || []) {
      const x = u.valToPos(d.t, "x", true);
      if (!isFinite(x) || x < left || x > left + width) continue;
      ctx.beginPath();
      ctx.moveTo(x, top);
      ctx.lineTo(x, top + height);
      ctx.stroke();
      ctx.fillText(`✕ ${d.group} step ${d.step}`, x + 3 * dpr, top + 12 * dpr);
    }
  }

  return {
    hooks: {
      drawClear: [(u) => {
        const s = getStatus();
        if (!s) return;
        u.ctx.save();
        drawBands(u, s);
        u.ctx.restore();
      }],
      // Drawn over the series, so a mark stays visible where the lines cross it.
      draw: [(u) => {
        const s = getStatus();
        if (!s) return;
        u.ctx.save();
        drawDivergences(u, s);
        u.ctx.restore();
      }],
    },
  };
};
