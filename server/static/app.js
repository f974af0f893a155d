// Refresh the page's content in place every few seconds: fetch this URL's fragment and swap it in.
(function () {
  "use strict";
  const main = document.getElementById("content");
  const status = document.getElementById("refresh-status");
  if (!main) return;
  const seconds = Number(main.dataset.refresh || 5);

  async function refresh() {
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
      status.textContent = "updated " + new Date().toLocaleTimeString();
    } catch (error) {
      status.textContent = "refresh failed (" + error.message + "); retrying";
    }
  }

  window.setInterval(refresh, seconds * 1000);
})();
