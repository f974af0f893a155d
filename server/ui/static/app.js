// Keep the page's content current: refetch this URL's fragment and swap it in when the event stream
// says something changed (/ui/events, Server-Sent Events), or every few seconds while the stream is
// down (polling is the fallback).
(function () {
  "use strict";
  const main = document.getElementById("content");
  const status = document.getElementById("refresh-status");
  if (!main) return;
  const seconds = Number(main.dataset.refresh || 5);
  let streaming = false;
  let pending = null;

  async function refresh() {
    pending = null;
    if (document.hidden) return;
    try {
      const response = await fetch(window.location.href, {
        headers: { "X-Fragment": "1" },
        credentials: "same-origin",
        cache: "no-store",
      });
      if (response.status === 401) {
        window.location.reload(); // the session ended: show the sign-in form
        return;
      }
      if (!response.ok) throw new Error("HTTP " + response.status);
      const html = await response.text();
      const scroll = [window.scrollX, window.scrollY];
      main.innerHTML = html;
      window.scrollTo(scroll[0], scroll[1]);
      status.textContent = (streaming ? "live, " : "polling, ") + "updated " + new Date().toLocaleTimeString();
    } catch (error) {
      status.textContent = "refresh failed (" + error.message + "); retrying";
    }
  }

  function soon() {
    if (pending === null) pending = window.setTimeout(refresh, 250); // one refresh for a burst of events
  }

  if (window.EventSource && main.dataset.events) {
    const source = new EventSource(main.dataset.events, { withCredentials: true });
    source.onopen = function () { streaming = true; };
    source.onmessage = soon;
    source.onerror = function () { streaming = false; }; // EventSource reconnects on its own
  }
  window.setInterval(function () { if (!streaming) refresh(); }, seconds * 1000);
})();
