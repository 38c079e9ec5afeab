// Debian 13's npm (9.2.0~ds1-3) sends no proxy credential: its make-fetch-happen builds the
// proxy agent from an options object carrying `auth`, but it runs on Debian's
// https-proxy-agent / http-proxy-agent 7, which read the credential only from the proxy URL's
// `username` and `password` (agent-base 7's API). The CONNECT then goes out without
// Proxy-Authorization, whatever npm_config_https_proxy says: a token-only Sandgate refuses
// every request with 407, and one that also knows the sandbox by its Docker label never sees
// the token at all (tests/integration/clients/test_matrix.py::test_npm_install caught it).
//
// Run at image build (as root): adds the URL's username and password to those options, then
// proves with a real CONNECT to a local socket that npm's agent sends the credential. It fails
// the build when the file is not the one this patch knows and npm still sends none; it changes
// nothing when npm already sends it (a fixed Debian package).
'use strict';
const fs = require('fs'), net = require('net'), https = require('https');
const AGENT = '/usr/share/nodejs/npm/node_modules/make-fetch-happen/lib/agent.js';
const ANCHOR = '    auth: getAuth(proxyUrl),\n';
const ADDED = '    username: proxyUrl.username, password: proxyUrl.password,  // sandgate: see npm-proxy-auth.js\n';

function proxyAuthSent() {
  // The CONNECT head npm's proxy agent writes for https://registry.test/ via a local "proxy".
  delete require.cache[require.resolve(AGENT)];
  const { getProxy } = require(AGENT);
  return new Promise((resolve, reject) => {
    const server = net.createServer((sock) => {
      let head = '';
      sock.on('data', (d) => {
        head += d;
        if (!head.includes('\r\n\r\n')) return;
        sock.end('HTTP/1.1 407 Proxy Authentication Required\r\nContent-Length: 0\r\n\r\n');
        server.close();
        resolve(/^proxy-authorization: Basic dXNlcjp0b2svZW4=\r$/im.test(head));  // user:tok/en
      });
    }).listen(0, '127.0.0.1', () => {
      const url = new URL(`http://user:tok%2Fen@127.0.0.1:${server.address().port}`);
      https.get('https://registry.test/', { agent: getProxy(url, {}, true) })
        .on('error', () => {}).end();
    });
    setTimeout(() => reject(new Error('no CONNECT reached the local proxy in 10 s')), 10000)
      .unref();
  });
}

(async () => {
  if (await proxyAuthSent()) {
    console.log('npm-proxy-auth: npm sends the proxy credential already; nothing changed');
    return;
  }
  const src = fs.readFileSync(AGENT, 'utf8');
  if (!src.includes(ANCHOR) || src.includes(ADDED)) {
    throw new Error(`${AGENT} is not the file this patch knows; npm sends no proxy credential`);
  }
  fs.writeFileSync(AGENT, src.replace(ANCHOR, ANCHOR + ADDED));
  if (!(await proxyAuthSent())) {
    throw new Error('patched, yet npm still sends no Proxy-Authorization');
  }
  console.log('npm-proxy-auth: patched make-fetch-happen: npm sends the proxy credential');
})().catch((e) => { console.error(`npm-proxy-auth: ${e.message}`); process.exit(1); });
