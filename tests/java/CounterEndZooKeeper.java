import java.io.BufferedReader;
import java.io.File;
import java.io.InputStreamReader;
import java.net.InetSocketAddress;
import java.util.concurrent.CountDownLatch;
import java.util.concurrent.TimeUnit;

import org.apache.zookeeper.CreateMode;
import org.apache.zookeeper.KeeperException;
import org.apache.zookeeper.Watcher;
import org.apache.zookeeper.ZooDefs;
import org.apache.zookeeper.ZooKeeper;
import org.apache.zookeeper.server.DataNode;
import org.apache.zookeeper.server.ServerCnxnFactory;
import org.apache.zookeeper.server.ZooKeeperServer;

/**
 * A ZooKeeper server in this JVM whose containers' child counters can be set.
 *
 * <pre>
 * java CounterEndZooKeeper &lt;dataDir&gt; &lt;port&gt;
 * </pre>
 *
 * Serves on 127.0.0.1:port (tick 500 ms, no container reaping) and prints
 * "ready". Then reads commands on stdin, one a line, answering each with
 * "ok ..." or "error ...":
 * "counter PATH N" creates the container PATH (and persistent parents) if
 * missing and sets its child counter (cversion) in the data tree to N, so
 * that its next sequential child is numbered N; "cversion PATH" prints it.
 * Stops when stdin closes.
 */
public final class CounterEndZooKeeper {
    public static void main(String[] args) throws Exception {
        File dir = new File(args[0]);
        int port = Integer.parseInt(args[1]);
        ZooKeeperServer server = new ZooKeeperServer(dir, dir, 500);
        server.setMinSessionTimeout(1000);
        server.setMaxSessionTimeout(30000);
        ServerCnxnFactory factory = ServerCnxnFactory.createFactory();
        factory.configure(new InetSocketAddress("127.0.0.1", port), 0);
        factory.startup(server);

        CountDownLatch connected = new CountDownLatch(1);
        ZooKeeper client = new ZooKeeper("127.0.0.1:" + port, 10000, event -> {
            if (event.getState() == Watcher.Event.KeeperState.SyncConnected) {
                connected.countDown();
            }
        });
        if (!connected.await(30, TimeUnit.SECONDS)) {
            throw new IllegalStateException("no session with the in-process server");
        }
        System.out.println("ready");
        System.out.flush();

        BufferedReader in = new BufferedReader(new InputStreamReader(System.in));
        String line;
        while ((line = in.readLine()) != null) {
            String[] words = line.trim().split(" ");
            try {
                if (words[0].equals("counter")) {
                    String path = words[1];
                    int counter = Integer.parseInt(words[2]);
                    create(client, path);
                    DataNode node = server.getZKDatabase().getDataTree().getNode(path);
                    synchronized (node) {
                        node.stat.setCversion(counter);
                    }
                    System.out.println("ok " + node.stat.getCversion());
                } else if (words[0].equals("cversion")) {
                    DataNode node = server.getZKDatabase().getDataTree().getNode(words[1]);
                    System.out.println("ok " + (node == null ? "none" : node.stat.getCversion()));
                } else {
                    System.out.println("error unknown command " + words[0]);
                }
            } catch (Exception e) {
                System.out.println("error " + e);
            }
            System.out.flush();
        }
        client.close();
        factory.shutdown();
        server.shutdown();
        System.exit(0);
    }

    /** Creates PATH as a container, its missing ancestors as persistent nodes. */
    private static void create(ZooKeeper client, String path) throws Exception {
        int at = 0;
        while ((at = path.indexOf('/', at + 1)) > 0) {
            try {
                client.create(path.substring(0, at), new byte[0], ZooDefs.Ids.OPEN_ACL_UNSAFE,
                        CreateMode.PERSISTENT);
            } catch (KeeperException.NodeExistsException e) {
                // already there
            }
        }
        try {
            client.create(path, new byte[0], ZooDefs.Ids.OPEN_ACL_UNSAFE, CreateMode.CONTAINER);
        } catch (KeeperException.NodeExistsException e) {
            // already there
        }
    }
}
